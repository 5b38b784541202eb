"""Train with PyTorch Lightning (DDP) from a pipeline-server.

python lightning_ddp.py --server tcp://HOST:5555 --devices 2 --ckpt-dir ckpt
python lightning_ddp.py --server tcp://HOST:5555 --devices 2 --resume ckpt/STEP.ckpt
A server beyond this host serves only holders of its keys: add --keys DIR (see pipeline-keys).
Metrics per epoch go to LOG_DIR/lightning_logs/version_N/metrics.csv (--log-dir) and the
progress bar.
"""

import argparse

import lightning as L
import torch
import torch.nn.functional as F
from batchwire.client import RemoteLoader
from batchwire.client.lightning import RemoteLoaderCallback
from torch.utils.data import DataLoader


class Classifier(L.LightningModule):
    def __init__(self, server: str, keys: str | None, wrap: bool) -> None:
        super().__init__()
        # Built before DDP starts: rank, world size and device (LOCAL_RANK's GPU) are resolved
        # when a loader first connects, inside the DDP process.
        self.loaders = {split: RemoteLoader(server, split, keys=keys) for split in ("train", "val")}
        self.wrap = wrap  # the loader itself, or DataLoader(loader, batch_size=None): both work
        self.net = None

    def configure_model(self):
        # Here, not in __init__: asking the server for its class count connects the loader,
        # which must happen inside the DDP process (Lightning calls this after DDP starts).
        if self.net is None:
            self.net = torch.nn.Sequential(
                torch.nn.Conv2d(3, 32, 3, stride=2), torch.nn.ReLU(),
                torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                torch.nn.Linear(32, self.loaders["train"].num_classes),  # the server's classes
            )  # fmt: skip

    def _dataloader(self, split: str):
        loader = self.loaders[split]
        return DataLoader(loader, batch_size=None) if self.wrap else loader

    def train_dataloader(self):
        return self._dataloader("train")

    def val_dataloader(self):
        return self._dataloader("val")

    def training_step(self, batch, batch_idx):
        images, labels = batch
        loss = F.cross_entropy(self.net(images), labels)
        self.log("train_loss", loss, on_epoch=True, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        images, labels = batch
        real = labels != -100  # padding slots of the last val batches carry label -100
        correct = (self.net(images).argmax(1) == labels) & real
        n = int(real.sum())
        self.log("val_acc", correct.sum() / max(n, 1), batch_size=n, sync_dist=True, prog_bar=True)

    def on_train_epoch_end(self):
        m = self.trainer.callback_metrics  # validation ran before this hook
        self.print(f"epoch {self.current_epoch}: train loss {m['train_loss_epoch']:.4f}, "
                   f"val accuracy {100 * m.get('val_acc', torch.nan):.1f}%")  # fmt: skip

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--server", required=True)
    p.add_argument("--keys", default=None, help="the server's keys folder [$BATCHWIRE_KEYS]")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--ckpt-dir", default="ckpt")
    p.add_argument("--every-n-steps", type=int, default=50)
    p.add_argument("--resume", default=None, help="checkpoint to resume (mid-epoch is exact)")
    p.add_argument("--wrap", action="store_true", help="DataLoader(loader, batch_size=None)")
    p.add_argument("--log-dir", default="logs", help="metrics.csv per run (CSVLogger)")
    args = p.parse_args()

    trainer = L.Trainer(
        strategy="ddp",
        devices=args.devices,
        max_epochs=args.epochs,
        callbacks=[
            RemoteLoaderCallback(),  # epochs and positions of wrapped loaders; harmless otherwise
            L.pytorch.callbacks.ModelCheckpoint(
                args.ckpt_dir, every_n_train_steps=args.every_n_steps, save_top_k=-1
            ),
        ],
        logger=L.pytorch.loggers.CSVLogger(args.log_dir),
    )
    model = Classifier(args.server, args.keys, args.wrap)
    trainer.fit(model, ckpt_path=args.resume)


if __name__ == "__main__":
    main()
