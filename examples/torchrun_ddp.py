"""Plain PyTorch DDP from a pipeline-server, with checkpoint and exact mid-epoch resume.

torchrun --nproc_per_node=2 torchrun_ddp.py --server tcp://HOST:5555 --ckpt ckpt.pt
(run the same command again after a crash: it resumes from ckpt.pt at the next batch)
A server beyond this host serves only holders of its keys: add --keys DIR (see pipeline-keys).
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from batchwire.client import RemoteLoader
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--server", required=True)
    p.add_argument("--keys", default=None, help="the server's keys folder [$BATCHWIRE_KEYS]")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--ckpt", default="ckpt.pt")
    p.add_argument("--every-n-steps", type=int, default=50)
    p.add_argument("--stop-after", type=int, default=0, help="exit after N steps (a crash drill)")
    args = p.parse_args()

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    main_rank = dist.get_rank() == 0
    # device=None: this rank's GPU (LOCAL_RANK) when CUDA is available, else the CPU.
    loader = RemoteLoader(args.server, "train", keys=args.keys)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, stride=2), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
        torch.nn.Linear(32, loader.num_classes),  # the server's class count
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
        loader.prefetch_next_epoch = epoch + 1 < args.epochs  # no batch made past the end
        totals = torch.zeros(3, device=device)  # loss sum, correct, images (this rank)
        for images, labels in tqdm(loader, desc=f"epoch {epoch}", disable=not main_rank):
            logits = model(images)
            loss = F.cross_entropy(logits, labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            totals[0] += loss.detach() * labels.numel()
            totals[1] += (logits.argmax(1) == labels).sum()
            totals[2] += labels.numel()
            step += 1
            if step % args.every_n_steps == 0 and main_rank:
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
        dist.all_reduce(totals)  # every rank's images
        loss_sum, correct, seen = totals.tolist()
        if main_rank:
            loss, accuracy = loss_sum / max(seen, 1), 100 * correct / max(seen, 1)
            print(f"epoch {epoch}: train loss {loss:.4f}, accuracy {accuracy:.1f}%", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
