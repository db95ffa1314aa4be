"""Scenes of coloured shapes: sampling, rendering, masks and the geometric scene graph.

Every image is drawn from its own random stream ``default_rng([seed, image_index])``, so image i is
the same whatever ``n_images`` is, and images could be produced in any order or in parallel.

Objects are drawn in order (later ones occlude earlier ones). ``box`` is the tight box of the whole
(amodal) shape; ``mask`` is its visible part, so the mask always lies inside the box. Placement is
rejected when it would leave an earlier object less than half visible.

Predicates (ordered pair subject -> object), decided from geometry in this order:

* ``in front of`` / ``behind``: the two whole shapes share pixels; the one drawn later is in front.
* otherwise, from the box centres (dx, dy) = subject - object, image y pointing down:
  ``left of`` (dx < 0) / ``right of`` (dx > 0) when |dx| >= |dy|, else ``above`` (dy < 0) /
  ``below`` (dy > 0).

So the relation of (b, a) is always the inverse of that of (a, b) (see ``INVERSE``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SHAPES = ["circle", "square", "triangle", "diamond", "star", "hexagon", "pentagon", "cross", "ring", "ellipse"]
PLURALS = {s: (s + "es" if s.endswith("s") else s + "s") for s in SHAPES}
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (214, 39, 40),
    "green": (44, 160, 44),
    "blue": (31, 90, 220),
    "yellow": (240, 208, 30),
    "orange": (255, 127, 14),
    "purple": (128, 60, 170),
    "pink": (240, 120, 190),
    "brown": (120, 72, 36),
    "black": (25, 25, 25),
    "white": (250, 250, 250),
    "gray": (120, 120, 120),
    "cyan": (23, 190, 207),
}
COLOR_NAMES = list(COLORS)
# radius as a fraction of the image side
SIZES: dict[str, tuple[float, float]] = {"small": (0.07, 0.10), "medium": (0.12, 0.15), "large": (0.18, 0.22)}
SIZE_NAMES = list(SIZES)
TEXTURES = ["plain", "plain", "plain", "striped", "dotted"]  # plain most often
BACKGROUND_COLORS: dict[str, tuple[int, int, int]] = {
    "beige": (225, 212, 180),
    "light gray": (200, 200, 200),
    "light blue": (185, 210, 235),
    "pale green": (195, 225, 190),
    "lavender": (215, 200, 230),
    "sand": (215, 190, 150),
}
BACKGROUND_PATTERNS = ["plain", "gradient", "checkered", "striped", "noisy"]
PREDICATES = ["left of", "right of", "above", "below", "in front of", "behind"]
INVERSE = {"left of": "right of", "right of": "left of", "above": "below", "below": "above",
           "in front of": "behind", "behind": "in front of"}


@dataclass
class Obj:
    shape: str
    color: str
    size: str
    texture: str
    cx: float
    cy: float
    r: float
    # amodal mask on the patch [y0:y0+h, x0:x0+w]
    patch: np.ndarray
    x0: int
    y0: int
    box: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    order: int = 0

    @property
    def center(self) -> tuple[float, float]:
        x0, y0, x1, y1 = self.box
        return (x0 + x1) / 2.0, (y0 + y1) / 2.0

    @property
    def area(self) -> int:
        return int(self.patch.sum())


@dataclass
class Scene:
    size: int
    background: str  # colour name
    pattern: str
    objects: list[Obj]
    owner: np.ndarray  # int16 [S, S]: index of the visible object, -1 background
    pixels: np.ndarray  # uint8 [S, S, 3]

    def visible_mask(self, k: int) -> np.ndarray:
        return self.owner == k


def _regular_polygon(dx, dy, R, k, rot):
    # Inside a convex regular polygon iff the projection on every edge normal is <= the apothem.
    phis = rot + np.pi / k + 2 * np.pi * np.arange(k) / k
    proj = dx[..., None] * np.cos(phis) + dy[..., None] * np.sin(phis)
    return proj.max(-1) <= R * np.cos(np.pi / k)


def shape_mask(shape: str, r: float, fx: float, fy: float) -> np.ndarray:
    """Amodal mask on a (2R+1)^2 patch centred at sub-pixel offset (fx, fy)."""
    R = int(np.ceil(r)) + 1
    ax = np.arange(-R, R + 1, dtype=np.float32)
    dx = ax[None, :] - fx
    dy = ax[:, None] - fy
    if shape == "circle":
        m = dx * dx + dy * dy <= r * r
    elif shape == "ring":
        d2 = dx * dx + dy * dy
        m = (d2 <= r * r) & (d2 >= (0.55 * r) ** 2)
    elif shape == "square":
        m = np.maximum(np.abs(dx), np.abs(dy)) <= 0.85 * r
    elif shape == "diamond":
        m = np.abs(dx) + np.abs(dy) <= r
    elif shape == "ellipse":
        m = (dx / r) ** 2 + (dy / (0.55 * r)) ** 2 <= 1.0
    elif shape == "cross":
        a, b = np.abs(dx), np.abs(dy)
        t = 0.33 * r
        m = ((a <= t) & (b <= r)) | ((b <= t) & (a <= r))
    elif shape == "triangle":
        m = _regular_polygon(dx, dy, r, 3, -np.pi / 2)
    elif shape == "pentagon":
        m = _regular_polygon(dx, dy, r, 5, -np.pi / 2)
    elif shape == "hexagon":
        m = _regular_polygon(dx, dy, r, 6, 0.0)
    elif shape == "star":
        # polar outline: radius goes linearly from the tip (r) to the notch (0.45 r) and back
        theta = np.arctan2(dy, dx) + np.pi / 2
        t = np.mod(theta, 2 * np.pi / 5) / (2 * np.pi / 5)
        lim = 0.45 * r + 0.55 * r * np.abs(1.0 - 2.0 * t)
        m = np.sqrt(dx * dx + dy * dy) <= lim
    else:
        raise ValueError(f"unknown shape {shape!r}")
    return m


def _background(rng: np.random.Generator, S: int, grid: tuple[np.ndarray, np.ndarray]) -> tuple[str, str, np.ndarray]:
    yy, xx = grid
    name = list(BACKGROUND_COLORS)[rng.integers(len(BACKGROUND_COLORS))]
    pattern = BACKGROUND_PATTERNS[rng.integers(len(BACKGROUND_PATTERNS))]
    base = np.array(BACKGROUND_COLORS[name], dtype=np.float32)
    if pattern == "plain":
        img = np.broadcast_to(base, (S, S, 3)).astype(np.float32)
    elif pattern == "gradient":
        t = (yy if rng.integers(2) else xx) / max(S - 1, 1)
        img = base * (1.0 - 0.35 * t[..., None])
    elif pattern == "checkered":
        c = max(S // int(rng.choice([6, 8, 12])), 2)
        alt = ((yy // c + xx // c) % 2).astype(np.float32)
        img = base * (1.0 - 0.18 * alt[..., None])
    elif pattern == "striped":
        w = max(S // int(rng.choice([10, 16])), 2)
        alt = (((xx if rng.integers(2) else yy) // w) % 2).astype(np.float32)
        img = base * (1.0 - 0.15 * alt[..., None])
    else:  # noisy
        img = base + rng.normal(0.0, 14.0, size=(S, S, 1)).astype(np.float32)
    return name, pattern, img


def _fill(obj: Obj, S: int) -> np.ndarray:
    """Colour of every patch pixel (texture applied), float32 [h, w, 3]."""
    h, w = obj.patch.shape
    col = np.array(COLORS[obj.color], dtype=np.float32)
    out = np.broadcast_to(col, (h, w, 3)).astype(np.float32)
    if obj.texture != "plain":
        yy = np.arange(obj.y0, obj.y0 + h)[:, None]
        xx = np.arange(obj.x0, obj.x0 + w)[None, :]
        if obj.texture == "striped":
            sel = ((xx + yy) // max(S // 32, 2)) % 2 == 1
        else:  # dotted
            step = max(S // 16, 4)
            sel = ((xx % step) < step // 2) & ((yy % step) < step // 2)
        # darken bright colours, lighten dark ones, so the pattern shows on every colour
        shade = col * 0.55 if col.mean() > 90 else col + (255 - col) * 0.5
        out = np.where(sel[..., None], shade, out)
    return out


def make_scene(rng: np.random.Generator, S: int, n_objects: int, grid, shape_offsets=None) -> Scene:
    """``shape_offsets`` (ints, one per object drawn): object k's shape is the drawn one moved on by
    ``shape_offsets[k]`` in ``SHAPES`` (mod its length); every other draw is unchanged, so the same ``rng`` state
    with offsets in 1..len(SHAPES)-1 gives a *twin* of the scene: the same background, colours, sizes, textures and
    places, each shape another (the generator's ``twins``; a placement can differ where the new outline no
    longer fits)."""
    bg_name, pattern, img = _background(rng, S, grid)
    owner = np.full((S, S), -1, dtype=np.int16)
    objs: list[Obj] = []
    visible: list[int] = []
    for k_draw in range(n_objects):
        shape = SHAPES[(int(rng.integers(len(SHAPES))) + (int(shape_offsets[k_draw]) if shape_offsets is not None else 0))
                       % len(SHAPES)]
        color = COLOR_NAMES[rng.integers(len(COLOR_NAMES))]
        size = SIZE_NAMES[rng.integers(len(SIZE_NAMES))]
        texture = TEXTURES[rng.integers(len(TEXTURES))]
        placed = None
        for attempt in range(30):
            if attempt == 20 and size != "small":
                size = "small"  # crowded scene: a smaller object is more likely to fit
            lo, hi = SIZES[size]
            r = float(rng.uniform(lo, hi)) * S
            R = int(np.ceil(r)) + 1
            cx = float(rng.uniform(R, S - 1 - R))
            cy = float(rng.uniform(R, S - 1 - R))
            ix, iy = int(round(cx)), int(round(cy))
            patch = shape_mask(shape, r, cx - ix, cy - iy)
            x0, y0 = ix - R, iy - R
            under = owner[y0:y0 + patch.shape[0], x0:x0 + patch.shape[1]][patch]
            hits = np.bincount(under[under >= 0], minlength=len(objs)) if len(objs) else np.zeros(0, int)
            if all(visible[j] - hits[j] >= 0.5 * objs[j].area for j in range(len(objs))):
                placed = Obj(shape, color, size, texture, cx, cy, r, patch, x0, y0)
                for j in range(len(objs)):
                    visible[j] -= int(hits[j])
                break
        if placed is None:
            continue
        k = len(objs)
        ys, xs = np.nonzero(placed.patch)
        placed.box = (float(x0 + xs.min()), float(y0 + ys.min()), float(x0 + xs.max() + 1), float(y0 + ys.max() + 1))
        placed.order = k
        h, w = placed.patch.shape
        region = img[y0:y0 + h, x0:x0 + w]
        region[placed.patch] = _fill(placed, S)[placed.patch]
        owner[y0:y0 + h, x0:x0 + w][placed.patch] = k
        objs.append(placed)
        visible.append(placed.area)
    pixels = np.clip(img, 0, 255).astype(np.uint8)
    return Scene(S, bg_name, pattern, objs, owner, pixels)


def shapes_overlap(a: Obj, b: Obj) -> bool:
    ax1, ay1 = a.x0 + a.patch.shape[1], a.y0 + a.patch.shape[0]
    bx1, by1 = b.x0 + b.patch.shape[1], b.y0 + b.patch.shape[0]
    x0, y0, x1, y1 = max(a.x0, b.x0), max(a.y0, b.y0), min(ax1, bx1), min(ay1, by1)
    if x0 >= x1 or y0 >= y1:
        return False
    pa = a.patch[y0 - a.y0:y1 - a.y0, x0 - a.x0:x1 - a.x0]
    pb = b.patch[y0 - b.y0:y1 - b.y0, x0 - b.x0:x1 - b.x0]
    return bool((pa & pb).any())


def predicate(a: Obj, b: Obj) -> str:
    if shapes_overlap(a, b):
        return "in front of" if a.order > b.order else "behind"
    (ax, ay), (bx, by) = a.center, b.center
    dx, dy = ax - bx, ay - by
    if abs(dx) >= abs(dy):
        return "left of" if dx < 0 else "right of"
    return "above" if dy < 0 else "below"


def relations(scene: Scene) -> list[tuple[int, int, str]]:
    """Every ordered pair of objects (subject index, object index, predicate)."""
    objs = scene.objects
    return [(i, j, predicate(objs[i], objs[j])) for i in range(len(objs)) for j in range(len(objs)) if i != j]
