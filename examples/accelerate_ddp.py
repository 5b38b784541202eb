"""Train with HF Accelerate from a pipeline-server (launch with accelerate launch or torchrun).

    torchrun --nproc_per_node=2 accelerate_ddp.py --server tcp://HOST:5555 --ckpt-dir ckpt
    torchrun --nproc_per_node=2 accelerate_ddp.py --server tcp://HOST:5555 --resume ckpt/step_50

Do not pass the loader (or a DataLoader around it) to accelerator.prepare(): Accelerate
re-shards iterable datasets between processes, and RemoteLoader already gives each rank its own
shard (it refuses to run under that wrapper, with this advice).
"""

import argparse
import os

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from batchwire.client import RemoteLoader
from torch.utils.data import DataLoader


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--server", required=True)
    p.add_argument("--num-classes", type=int, default=10)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--ckpt-dir", default="ckpt")
    p.add_argument("--every-n-steps", type=int, default=50)
    p.add_argument("--resume", default=None, help="a folder written by save_state")
    p.add_argument("--wrap", action="store_true", help="DataLoader(loader, batch_size=None)")
    args = p.parse_args()

    accelerator = Accelerator()
    loader = RemoteLoader(args.server, "train", device=accelerator.device, normalize_on_device=True)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, stride=2), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, args.num_classes),
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
        for images, labels in batches:
            loss = F.cross_entropy(model(images), labels)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step % args.every_n_steps == 0:
                accelerator.save_state(os.path.join(args.ckpt_dir, f"step_{step}"))


if __name__ == "__main__":
    main()
