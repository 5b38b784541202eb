"""Train with HF Accelerate from a pipeline-server (launch with accelerate launch or torchrun).

    torchrun --nproc_per_node=2 accelerate_ddp.py --server tcp://HOST:5555 --ckpt-dir ckpt
    torchrun --nproc_per_node=2 accelerate_ddp.py --server tcp://HOST:5555 --resume ckpt/step_50

A server beyond this host serves only holders of its keys: add --keys DIR (see pipeline-keys).
Do not pass the loader (or a DataLoader around it) to accelerator.prepare(): Accelerate
re-shards iterable datasets between processes, and RemoteLoader already gives each rank its own
shard (it refuses to run under that wrapper, with this advice).
On a host without CUDA, launch with ACCELERATE_USE_CPU=true (else each rank trains alone).
"""

import argparse
import os

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from batchwire.client import RemoteLoader
from torch.utils.data import DataLoader
from tqdm import tqdm


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--server", required=True)
    p.add_argument("--keys", default=None, help="the server's keys folder [$BATCHWIRE_KEYS]")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--ckpt-dir", default="ckpt")
    p.add_argument("--every-n-steps", type=int, default=50)
    p.add_argument("--resume", default=None, help="a folder written by save_state")
    p.add_argument("--wrap", action="store_true", help="DataLoader(loader, batch_size=None)")
    args = p.parse_args()

    accelerator = Accelerator()
    loader = RemoteLoader(args.server, "train", device=accelerator.device, keys=args.keys)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, stride=2), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
        torch.nn.Linear(32, loader.num_classes),  # the server's class count
    )  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.register_for_checkpointing(loader)  # its position goes into save_state()
    batches = DataLoader(loader, batch_size=None) if args.wrap else loader

    step = 0
    if args.resume:
        accelerator.load_state(args.resume)  # the loader resumes at the saved batch
        step = int(os.path.basename(args.resume.rstrip("/")).removeprefix("step_"))
    for epoch in range(loader.epoch, args.epochs):
        loader.set_epoch(epoch)
        loader.prefetch_next_epoch = epoch + 1 < args.epochs  # no batch made past the end
        totals = torch.zeros(3, device=accelerator.device)  # loss sum, correct, images
        bar = tqdm(batches, desc=f"epoch {epoch}", disable=not accelerator.is_main_process)
        for images, labels in bar:
            logits = model(images)
            loss = F.cross_entropy(logits, labels)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            totals[0] += loss.detach() * labels.numel()
            totals[1] += (logits.argmax(1) == labels).sum()
            totals[2] += labels.numel()
            step += 1
            if step % args.every_n_steps == 0:
                accelerator.save_state(os.path.join(args.ckpt_dir, f"step_{step}"))
        loss_sum, correct, seen = accelerator.reduce(totals, reduction="sum").tolist()
        loss, accuracy = loss_sum / max(seen, 1), 100 * correct / max(seen, 1)
        accelerator.print(f"epoch {epoch}: train loss {loss:.4f}, accuracy {accuracy:.1f}%")
    # Destroys the process group: a rank that exits with gloo's threads still running can abort
    # ("terminate called without an active exception").
    accelerator.end_training()


if __name__ == "__main__":
    main()
