"""The baseline: a plain PyTorch training loop, as one writes it without a trainer.

It uses the app's model and data classes (the same modules, so the same work per step) and
reproduces what the app's default run does around them, with nothing more: the seeding order,
a seeded shuffle per epoch, AdamW without weight decay on 1-d parameters, the app's warm-up +
cosine schedule, dropout seeded after the model is built. Its losses therefore equal the app's
bit for bit on any CPU, which tests/test_bench.py checks. No logging, validation or checkpoints.

    python bench/plain_loop.py --model cnn --steps 300 --losses losses.json
    torchrun --standalone --nproc_per_node=2 bench/plain_loop.py   # plain DDP (gloo)
"""

from __future__ import annotations

import argparse
import json
import os
import random

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from app.data import Digits, Synthetic
from app.env import reproducible_matmuls
from app.models import CNN, MLP, ResNet
from app.schedulers import warmup_cosine

# Like with like: the app runs MKL in its strict mode (the same bits on any thread count), and
# MKL's default mode rounds some products differently, by how much depending on the processor.
# The cost of the strict mode itself is measured apart (bench/blas_mode.py).
reproducible_matmuls()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["cnn", "mlp", "resnet"], default="cnn")
    p.add_argument("--channels", type=json.loads, default=None,
                   help="cnn: [32, 64], resnet: [16, 32, 64] by default")
    p.add_argument("--hidden", type=json.loads, default=[256, 256])
    p.add_argument("--data", choices=["digits", "synthetic"], default="digits")
    p.add_argument("--num-samples", type=int, default=4096)
    p.add_argument("--input-shape", type=json.loads, default=[1, 8, 8])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=0.003)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--losses", help="write the loss of every step here (JSON)")
    p.add_argument("--plot", help="draw the loss curve here (PNG, matplotlib), as app draws "
                                  "plots/curves.png at a run's end")
    p.add_argument("--device", default="cpu", help="cpu, or cuda (bench/gpu_steps.py)")
    return p


def train(args: argparse.Namespace) -> list[float]:
    """Train as the app's default run does; returns the loss of every step."""
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    data = (Digits(batch_size=args.batch) if args.data == "digits" else
            Synthetic(num_samples=args.num_samples, input_shape=args.input_shape,
                      batch_size=args.batch))
    if args.model == "cnn":
        model = CNN(data.input_shape, data.num_classes, channels=args.channels or [32, 64])
    elif args.model == "resnet":
        model = ResNet(data.input_shape, data.num_classes, channels=args.channels or [16, 32, 64])
    else:
        model = MLP(data.input_shape, data.num_classes, hidden=args.hidden)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    device = torch.device(args.device)
    model = model.to(device)
    train = model
    if world > 1:  # started by torchrun: plain DDP, each rank its share of every epoch
        torch.distributed.init_process_group("gloo")
        train = torch.nn.parallel.DistributedDataParallel(model)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(
        [{"params": [q for q in params if q.ndim > 1]},
         {"params": [q for q in params if q.ndim <= 1], "weight_decay": 0.0}],
        lr=args.lr, weight_decay=args.weight_decay)
    scheduler = warmup_cosine(optimizer, total_steps=args.steps, warmup_steps=args.warmup)
    torch.manual_seed(args.seed + rank)  # dropout

    losses = []
    model.train()
    epoch = 0
    while len(losses) < args.steps:
        order = torch.randperm(len(data.train),
                               generator=torch.Generator().manual_seed(args.seed + epoch))
        order = torch.cat([order, order[:(-len(order)) % world]])[rank::world]  # as DDP pads
        # The loader gets a generator of its own, as in the app: otherwise it draws its
        # workers' base seed from the global generator, which dropout uses.
        for x, y in DataLoader(data.train, batch_size=args.batch, sampler=order.tolist(),
                               drop_last=True, generator=torch.Generator()):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(train(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            losses.append(loss.detach())
            if len(losses) == args.steps:
                break
        epoch += 1
    if world > 1:
        torch.distributed.destroy_process_group()
    return [loss.item() for loss in losses]


def main() -> None:
    args = parser().parse_args()
    losses = train(args)
    if args.losses and int(os.environ.get("RANK", 0)) == 0:
        with open(args.losses, "w") as f:
            json.dump(losses, f)
    if args.plot and int(os.environ.get("RANK", 0)) == 0:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        figure = Figure(figsize=(6, 4))
        figure.add_subplot().plot(losses)
        FigureCanvasAgg(figure).print_png(args.plot)


if __name__ == "__main__":
    main()
