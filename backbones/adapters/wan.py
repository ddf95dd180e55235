"""WanTransformer3DModel (Wan 2.1 and 2.2, text-to-video and image-to-video) under TREAD routing.

The stack the Router indexes is the model's blocks (Wan2.1-T2V-14B: 40, 1.3B: 30). The video tokens, frames x
height x width in raster (t, h, w) order, are routed; the text (and image-to-video's image context) reach every
block through cross-attention, whole and never routed.

Rotary positions: Wan's self-attention rotates each token by the row of a 3-D rotary table that the model's `rope`
computes from the latent's shape: the token's frame, row and column frequencies side by side, (1, N, 1, Dh). Inside
a route every kept token gets the row of its original position: the table is gathered with the route's indices into
(B, k, 1, Dh), which Wan's own attention processor broadcasts over the heads just as it does the full one, so the
diffusers attention runs unchanged. A table computed afresh for the k kept tokens, as if they were a smaller video,
would renumber them, moving tokens to other frames, rows and columns; with a single frame (t = 1, image mode) a
table built from the kept count's shape is wrong in every axis at once.

Timesteps reach the model on the scheduler's scale, flow time t -> 1000 t, as WanPipeline gives them. One timestep
per sample; Wan 2.2 TI2V's per-token timesteps (its first-frame conditioning) are not taken.
"""

from __future__ import annotations

import torch

from backbones.adapters.common import RoutedTransformer, Step, Stream, run_block, split_cond
from routing import ConfigError

Grid3 = tuple[int, int, int]


class WanAdapter(RoutedTransformer):
    """x: (B, C, T, H, W) latents. cond: encoder_hidden_states (B, L, text_dim); for image-to-video also
    encoder_hidden_states_image (B, L_img, image_dim) and `condition` (B, C_cond, T, H, W), the mask and first-frame
    latents WanImageToVideoPipeline concatenates to x along channels; optionally attention_kwargs, force_keep."""

    family, model_class = "wan", "WanTransformer3DModel"

    @property
    def patch(self) -> tuple[int, int, int]:
        """(p_t, p_h, p_w): latent frames, rows and columns per token."""
        return tuple(self.model.config.patch_size)

    @property
    def latent_channels(self) -> int:
        """Channels of the latents the model denoises (image-to-video models take more: `condition` adds them)."""
        return self.model.config.out_channels or self.model.config.in_channels

    def build_steps(self):
        m = self.model

        def call(block, x, s: Stream):
            return run_block(m, block, x, s.text, s.extra["timestep_proj"], self.rotary(s, x.shape[1]))

        return [Step(b, call, "wan") for b in m.blocks]

    @staticmethod
    def rotary(s: Stream, k: int):
        """The rotary (cos, sin) for a block given k video tokens: (1, N, 1, Dh) when all, else (B, k, 1, Dh)."""
        pos = s.positions(k)
        if pos is None:
            return s.extra["rotary"]
        if "rotary" not in s.cache:
            # (1, N, 1, Dh) -> (N, Dh) -> (B, k, Dh) -> (B, k, 1, Dh): each kept token's own (t, h, w) row.
            s.cache["rotary"] = tuple(full[0, :, 0][pos][:, :, None] for full in s.extra["rotary"])
        return s.cache["rotary"]

    def grid_of(self, x: torch.Tensor) -> Grid3:
        """The token grid of latents x (B, C, T, H, W); ConfigError when a side is not a whole number of patches."""
        if x.ndim != 5:
            raise ConfigError(f"the wan adapter takes video latents (batch, channels, frames, height, width), got shape {tuple(x.shape)}.")
        sides, names = x.shape[2:], ("frames", "height", "width")
        bad = [f"{name} {n} (patch {p})" for name, n, p in zip(names, sides, self.patch) if n < p or n % p]
        if bad:
            raise ConfigError(f"latents of {'x'.join(map(str, sides))} do not split into the model's {'x'.join(map(str, self.patch))} "
                              f"patches: {', '.join(bad)}; use clips whose latent frames, height and width are multiples of the patch.")
        return tuple(n // p for n, p in zip(sides, self.patch))

    def model_input(self, x: torch.Tensor, cond: dict) -> torch.Tensor:
        """x, with image-to-video's condition latents concatenated along channels as the pipeline does."""
        condition = cond.get("condition")
        return x if condition is None else torch.cat([x, condition.to(x.dtype)], dim=1)

    def embed(self, x, t, cond):
        m = self.model
        grid = self.grid_of(x)
        hidden = self.model_input(x, cond)
        # As WanTransformer3DModel.forward: the rotary table from the latent's shape, the patch embedding, then the
        # time, text (and image) embeddings.
        rotary = m.rope(hidden)  # cos, sin: (1, N, 1, Dh)
        tokens = m.patch_embedding(hidden).flatten(2).transpose(1, 2).contiguous()  # (B, D, t, h, w) -> (B, N, D)
        temb, timestep_proj, text, image = m.condition_embedder(t * 1000, cond["encoder_hidden_states"],
                                                                cond.get("encoder_hidden_states_image"))
        timestep_proj = timestep_proj.unflatten(1, (6, -1))  # (B, 6 D) -> (B, 6, D)
        if image is not None:
            text = torch.concat([image, text], dim=1)  # image-to-video: image context first, as the model orders it
        extra = {"rotary": rotary, "timestep_proj": timestep_proj}
        return tokens, Stream(temb, tokens.shape[1], text=text, extra=extra), grid

    def head(self, tokens, stream, grid):
        m = self.model
        shift, scale = (m.scale_shift_table.to(stream.temb.device) + stream.temb.unsqueeze(1)).chunk(2, dim=1)
        out = (m.norm_out(tokens.float()) * (1 + scale) + shift).type_as(tokens)
        return unpatchify3d(m.proj_out(out), grid, self.patch)

    def oracle(self, x, t, cond=None, **kwargs):
        cond, _ = split_cond(cond, kwargs)
        t = t.reshape(-1).expand(x.shape[0])
        return self.model(
            self.model_input(x, cond), timestep=t * 1000, encoder_hidden_states=cond["encoder_hidden_states"],
            encoder_hidden_states_image=cond.get("encoder_hidden_states_image"), attention_kwargs=cond.get("attention_kwargs"),
            return_dict=False,
        )[0]

    def conditioning(self, cond, kwargs):
        cond, mask = split_cond(cond, kwargs)
        if cond.get("attention_kwargs"):
            # diffusers applies attention_kwargs (a LoRA scale) around its own forward, which the adapter replaces.
            raise ConfigError("the wan adapter does not take attention_kwargs; set a LoRA's scale through peft instead.")
        return cond, mask


def unpatchify3d(x: torch.Tensor, grid: Grid3, patch: tuple[int, int, int]) -> torch.Tensor:
    """(B, t*h*w, p_t*p_h*p_w*C) -> (B, C, t*p_t, h*p_h, w*p_w), the token's features ordered (p_t, p_h, p_w, C) as
    Wan's proj_out writes them."""
    (t, h, w), (pt, ph, pw), b = grid, patch, x.shape[0]
    x = x.reshape(b, t, h, w, pt, ph, pw, -1)  # (B, t, h, w, p_t, p_h, p_w, C)
    x = x.permute(0, 7, 1, 4, 2, 5, 3, 6)  # (B, C, t, p_t, h, p_h, w, p_w)
    return x.reshape(b, x.shape[1], t * pt, h * ph, w * pw)


def frames_per_latent(vae_config) -> int:
    """Video frames per latent frame after the first (Wan's VAE: 4, the first latent frame holds one frame)."""
    return int(getattr(vae_config, "scale_factor_temporal", None) or 2 ** sum(vae_config.temperal_downsample))


def latent_frames(frames: int, temporal: int) -> int:
    """Latent frames of a clip of `frames` frames: 1 + (frames - 1) / temporal, as Wan's causal VAE encodes."""
    return 1 + (frames - 1) // temporal
