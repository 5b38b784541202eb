"""Plain PyTorch DDP from a pipeline-server, with checkpoint and exact mid-epoch resume.

torchrun --nproc_per_node=2 torchrun_ddp.py --server tcp://HOST:5555 --ckpt ckpt.pt
(run the same command again after a crash: it resumes from ckpt.pt at the next batch)
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from batchwire.client import RemoteLoader
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--server", required=True)
    p.add_argument("--num-classes", type=int, default=10)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--ckpt", default="ckpt.pt")
    p.add_argument("--every-n-steps", type=int, default=50)
    p.add_argument("--stop-after", type=int, default=0, help="exit after N steps (a crash drill)")
    args = p.parse_args()

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    # device=None: this rank's GPU (LOCAL_RANK) when CUDA is available, else the CPU.
    loader = RemoteLoader(args.server, "train", normalize_on_device=True)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, stride=2), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, args.num_classes),
    )  # fmt: skip
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    model = DDP(model.to(device), device_ids=[device] if cuda else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    step = 0
    if os.path.exists(args.ckpt):
        state = torch.load(args.ckpt, map_location="cpu", weights_only=False)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        loader.load_state_dict(state["loader"])  # rank 0's position holds for every rank
        step = state["step"]
    for epoch in range(loader.epoch, args.epochs):
        loader.set_epoch(epoch)
        for images, labels in loader:
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if step % args.every_n_steps == 0 and dist.get_rank() == 0:
                state = {
                    "model": model.module.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "loader": loader.state_dict(),
                    "step": step,
                }
                torch.save(state, args.ckpt + ".tmp")
                os.replace(args.ckpt + ".tmp", args.ckpt)  # atomic: a crash never leaves half
            if step == args.stop_after:
                dist.destroy_process_group()
                return
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
