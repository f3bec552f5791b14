"""Token geometry every family shares: latent shape, patch grid, patchify, and the position-table cache.

A video of F x H x W pixels is a latent of T x h x w (the VAE's compression), cut into patches of
pt x p x p: the token grid (T/pt, h/p, w/p), flattened in (t, h, w) order. `data` below is anything with
num_frames, height and width (the experiment's `data:` section).
"""
from __future__ import annotations

import functools

import torch
from einops import rearrange


def vae_frames(model, data) -> int:
    """Latent frames the VAE makes of data.num_frames frames: (F - 1) / temporal compression + 1."""
    return (data.num_frames - 1) // model.vae_scale_temporal + 1


def latent_shape(model, data) -> tuple[int, int, int]:
    """Latent (frames, height, width) the model takes for a data.num_frames x data.height x data.width video:
    the VAE's frames padded at the front to a multiple of patch_size_t (CogVideoX 1.5: 81 frames -> 21
    latent frames -> 22), as CogVideoXPipeline.__call__ does ("the latent frames should be padded to make
    it divisible by patch_size_t"); `pad_frames` pads a VAE latent so."""
    pt = model.patch_size_t
    t = -(-vae_frames(model, data) // pt) * pt
    return t, data.height // model.vae_scale_spatial, data.width // model.vae_scale_spatial


def pad_frames(latent: torch.Tensor, model) -> torch.Tensor:
    """[..., C, T, H, W] -> [..., C, T', H, W], T' the next multiple of patch_size_t: copies of the first frame
    in front, as CogVideo's fine-tuning pads 1.5 latents (finetune/models/cogvideox_t2v/lora_trainer.py:
    "Copy the first frame ncopy times to match patch_size_t"); the pipeline drops that many frames in front
    before decoding."""
    pad = -latent.shape[-3] % model.patch_size_t
    if pad == 0:
        return latent
    first = latent.narrow(-3, 0, 1)
    return torch.cat([first.expand(*first.shape[:-3], pad, *first.shape[-2:]), latent], dim=-3)


def token_grid(model, data) -> tuple[int, int, int]:
    """Patch grid (t, h, w): latent shape divided by the patch sizes."""
    t, h, w = latent_shape(model, data)
    return t // model.patch_size_t, h // model.patch_size, w // model.patch_size


def latent_grid(model, latent: tuple[int, int, int]) -> tuple[int, int, int]:
    """Patch grid (t, h, w) of a latent of (frames, height, width): one bucket's grid."""
    t, h, w = latent
    return t // model.patch_size_t, h // model.patch_size, w // model.patch_size


class StepGrid:
    """The token grid (t, h, w) of the step being run, one object shared by every stage of a model.

    Built with the config's grid; a bucketed run sets each step's bucket (`set`) on every rank before the
    step, so the stages (which are built once) read the step's shape when they run: position tables,
    the sp token count, unpatchify. Behaves as the (t, h, w) tuple it holds (`t, h, w = grid`,
    `math.prod(grid)`, `grid[1]`).
    """

    def __init__(self, grid: tuple[int, int, int], model=None):
        self.model = model            # patch sizes, for set_latent
        self.set(grid)

    def set(self, grid) -> None:
        self.value = tuple(int(n) for n in grid)

    def set_latent(self, latent) -> None:
        """The grid of a latent of (frames, height, width) (validation: each sample's own shape)."""
        self.set(latent_grid(self.model, tuple(latent)))

    def __iter__(self):
        return iter(self.value)

    def __getitem__(self, i):
        return self.value[i]

    def __len__(self) -> int:
        return len(self.value)

    def __repr__(self) -> str:
        return f"StepGrid{self.value}"


def patchify(latents: torch.Tensor, model) -> torch.Tensor:
    """[B, C, T, H, W] -> [B, t*h*w, C*pt*p*p] patch tokens in (t, h, w) order."""
    p, pt = model.patch_size, model.patch_size_t
    return rearrange(latents, "b c (t pt) (h p) (w q) -> b (t h w) (c pt p q)", pt=pt, p=p, q=p)


def unpatchify(tokens: torch.Tensor, model, grid) -> torch.Tensor:
    """patchify's inverse: [B, t*h*w, C*pt*p*p] -> [B, C, T, H, W]."""
    t, h, w = grid
    p, pt = model.patch_size, model.patch_size_t
    return rearrange(tokens, "b (t h w) (c pt p q) -> b c (t pt) (h p) (w q)", t=t, h=h, w=w, pt=pt, p=p, q=p)


def video_latent(latent: torch.Tensor, model, data) -> torch.Tensor:
    """[..., C, T, H, W] -> the VAE's frames only: `pad_frames`' front padding dropped before decoding, as
    CogVideoXPipeline does ("Discard any padding frames that were added for CogVideoX 1.5")."""
    pad = latent.shape[-3] - vae_frames(model, data)
    return latent.narrow(-3, pad, latent.shape[-3] - pad) if pad > 0 else latent


_SHARED_TABLES: dict = {}    # (table function and its fixed arguments, grid, device) -> tensors, one per process


class PositionCache:
    """Fixed positional tables per token grid, built on first use on the device that asks, and shared by
    every module that asks for the same table: the 42 blocks of CogVideoX-5B hold one RoPE table (at
    53,040 video tokens 25 MiB, not 1 GiB).

    `table` is a module-level function with its fixed arguments bound by `functools.partial`
    (`partial(rope_3d, head_dim, base=base)`); `get(key)` calls `table(*key)`. The sharing key is the
    function and its bound arguments, so two caches share a table exactly when they would compute it.

    `grid` (a block's: the StepGrid its steps read) and `key` (the grid's (t, h, w) -> the key its block asks
    `get` for; the grid itself by default) let `warm` build the step's table before a compiled block runs
    (parallel/distributed/compile.py). Inside a compiled block, a table built by the block's own first call would be
    a guard failure of the next: dynamo guards on the `tables` lookup, which misses in the first trace and hits
    after, so every step shape would compile its graph twice. A key `warm` gets wrong costs that recompilation and
    an unused table, never a wrong number: `get` is given the block's own key.
    """

    def __init__(self, table: functools.partial, grid=None, key=tuple):
        self.fn, self.grid, self.key = table, grid, key
        self.ident = (table.func.__module__, table.func.__qualname__, table.args, tuple(sorted(table.keywords.items())))
        self.tables = {}

    def get(self, key: tuple, device):
        key = tuple(key)                      # a StepGrid: the step's grid, not the object
        if (key, device) not in self.tables:
            shared = (self.ident, key, str(device))
            if shared not in _SHARED_TABLES:
                with torch.device("cpu"):     # the same numbers whatever device or trace context asks
                    value = self.fn(*key)
                _SHARED_TABLES[shared] = tuple(v.to(device) for v in value) if isinstance(value, tuple) \
                    else value.to(device)
            self.tables[(key, device)] = _SHARED_TABLES[shared]
        return self.tables[(key, device)]

    def warm(self, device) -> None:
        """The table of the grid's current step on `device`, built now (eager) if it is not yet."""
        if self.grid is not None:
            self.get(self.key(tuple(self.grid)), device)


def frames_key(grid: tuple[int, int, int]) -> tuple[int]:
    """The PositionCache key of a table of the t latent frames alone (STDiT's temporal rotary)."""
    return (grid[0],)


def position_caches(module: torch.nn.Module) -> list[PositionCache]:
    """The PositionCaches of `module` and its submodules that `warm` can build (those given their grid)."""
    return [value for m in module.modules() for value in vars(m).values()
            if isinstance(value, PositionCache) and value.grid is not None]
