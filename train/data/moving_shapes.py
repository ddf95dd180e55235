"""A tiny offline video fixture: coloured shapes moving across a black frame, each clip with its caption.

`write_moving_shapes(folder, ...)` writes clips in the layouts `data=videos` reads: animated GIFs (`clip_000.gif` +
`clip_000.txt`) and, for every `frame_folders`-th clip, a folder of PNG frames (`clip_001/000.png ...` +
`clip_001.txt`). A caption names the colour, the shape and the direction ("a red square moving right"), so a model
must learn motion, not only appearance, to tell the captions apart. Deterministic from the seed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

COLOURS = {"red": (230, 40, 40), "blue": (40, 90, 230), "green": (40, 200, 70)}
SHAPES = ("square", "disk")
DIRECTIONS = {"right": (1, 0), "left": (-1, 0), "down": (0, 1), "up": (0, -1)}
WORDS = ["a", "moving", *COLOURS, *SHAPES, *DIRECTIONS]  # every word of every caption


def draw_clip(colour: str, shape: str, direction: str, frames: int, size: int, rng: np.random.Generator) -> list[Image.Image]:
    """`frames` RGB frames of one shape crossing a size x size frame in `direction`, from a random start."""
    side = size // 4
    dx, dy = DIRECTIONS[direction]
    speed = (size - side) / max(frames - 1, 1) * 0.8  # crosses most of the frame in the clip
    travel = speed * (frames - 1)
    # Start where the whole path stays inside the frame.
    x0 = rng.uniform(*((0, size - side - travel) if dx > 0 else (travel, size - side) if dx < 0 else (0, size - side)))
    y0 = rng.uniform(*((0, size - side - travel) if dy > 0 else (travel, size - side) if dy < 0 else (0, size - side)))
    out = []
    for i in range(frames):
        x, y = x0 + dx * speed * i, y0 + dy * speed * i
        image = Image.new("RGB", (size, size))
        box = (round(x), round(y), round(x) + side, round(y) + side)
        draw = ImageDraw.Draw(image)
        (draw.rectangle if shape == "square" else draw.ellipse)(box, fill=COLOURS[colour])
        out.append(image)
    return out


def write_moving_shapes(folder: str | Path, clips: int = 16, frames: int = 9, size: int = 64, seed: int = 0,
                        frame_folders: int = 4) -> Path:
    """Write `clips` captioned clips under `folder` (GIFs; every `frame_folders`-th one a folder of PNGs, 0: none)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    combos = [(c, s, d) for c in COLOURS for s in SHAPES for d in DIRECTIONS]
    for k in range(clips):
        colour, shape, direction = combos[rng.integers(len(combos))] if k >= len(combos) else combos[k * 5 % len(combos)]
        images = draw_clip(colour, shape, direction, frames, size, rng)
        name = f"clip_{k:03d}"
        if frame_folders and k % frame_folders == frame_folders - 1:
            (folder / name).mkdir(exist_ok=True)
            for i, image in enumerate(images):
                image.save(folder / name / f"{i:03d}.png")
        else:
            images[0].save(folder / f"{name}.gif", save_all=True, append_images=images[1:], duration=125, loop=0)
        (folder / f"{name}.txt").write_text(f"a {colour} {shape} moving {direction}\n")
    return folder
