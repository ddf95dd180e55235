"""PixArtTransformer2DModel (PixArt-alpha / PixArt-Sigma) under TREAD routing.

Each block runs self-attention over the image tokens and cross-attention from them to the text; only image
tokens are routed, so a kept token attends to the other kept tokens and to all of the text (its mask too).
Absolute positions are added in the patch embedding, before the blocks, so gathered tokens keep them. The
timestep goes through adaLN-single once, as in the model, and every block reads the same modulation.

Output: PixArt predicts noise and, with learned sigma, a variance; `net(...)` returns the first C channels
as the velocity, so fine-tuning with `edm.FlowLoss` turns the model into a flow model (t -> 1000 t).
"""

from __future__ import annotations

from backbones.adapters.common import RoutedTransformer, Step, Stream, run_block, split_cond, unpatchify
from routing import ConfigError


class PixArtAdapter(RoutedTransformer):
    """cond: encoder_hidden_states (B, L, caption_channels), optionally encoder_attention_mask (B, L) with
    1 = keep, added_cond_kwargs (resolution, aspect_ratio when the model uses them), cross_attention_kwargs,
    force_keep."""

    family, model_class = "pixart", "PixArtTransformer2DModel"

    def build_steps(self):
        m = self.model

        def call(block, x, s: Stream):
            e = s.extra
            return run_block(m, block, x, None, s.text, e["text_mask"], s.temb, e["attention"], None)

        return [Step(b, call, "self+cross") for b in m.transformer_blocks]

    def embed(self, x, t, cond):
        m = self.model
        b, p = x.shape[0], self.patch
        text_mask = cond.get("encoder_attention_mask")
        if text_mask is not None and text_mask.ndim == 2:
            # As the model does: 1 = keep -> a (B, 1, L) additive bias, 0 kept, -10000 masked.
            text_mask = ((1 - text_mask.to(x.dtype)) * -10000.0).unsqueeze(1)
        added = cond.get("added_cond_kwargs")
        if m.use_additional_conditions and added is None:
            raise ConfigError(
                "this PixArt model (sample_size 128) conditions on resolution and aspect ratio; "
                "give cond['added_cond_kwargs'] = {'resolution': (B, 2), 'aspect_ratio': (B, 1)}."
            )
        tokens = m.pos_embed(x)  # (B, N, D), absolute positions already added
        temb, embedded = m.adaln_single(t * 1000, added, batch_size=b, hidden_dtype=tokens.dtype)  # (B, 6D), (B, D)
        text = cond["encoder_hidden_states"]
        if m.caption_projection is not None:
            text = m.caption_projection(text).view(b, -1, tokens.shape[-1])  # (B, L, D)
        extra = {"text_mask": text_mask, "attention": cond.get("cross_attention_kwargs"), "embedded": embedded}
        return tokens, Stream(temb, tokens.shape[1], text=text, extra=extra), (x.shape[-2] // p, x.shape[-1] // p)

    def head(self, tokens, stream, grid):
        m = self.model
        shift, scale = (m.scale_shift_table[None] + stream.extra["embedded"][:, None]).chunk(2, dim=1)  # (B, 1, D) each
        out = m.proj_out(m.norm_out(tokens) * (1 + scale) + shift)  # (B, N, p * p * C_out)
        return unpatchify(out, grid, self.patch, channels_last=True)[:, : m.config.in_channels]

    def oracle(self, x, t, cond=None, **kwargs):
        cond, _ = split_cond(cond, kwargs)
        t = t.reshape(-1).expand(x.shape[0])
        out = self.model(
            x, encoder_hidden_states=cond["encoder_hidden_states"], timestep=t * 1000,
            added_cond_kwargs=cond.get("added_cond_kwargs"), cross_attention_kwargs=cond.get("cross_attention_kwargs"),
            encoder_attention_mask=cond.get("encoder_attention_mask"), return_dict=False,
        )[0]
        return out[:, : self.model.config.in_channels]
