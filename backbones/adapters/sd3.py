"""SD3Transformer2DModel (Stable Diffusion 3 / 3.5, MMDiT) under TREAD routing.

Joint attention runs the context (text) stream beside the image tokens in every block; only image tokens
are routed, and every block still updates the whole context stream. SD3 adds its absolute 2-D sin-cos
positions in the patch embedding, before the blocks, so a gathered token carries its own position with it.
SD3.5's dual-attention blocks (a second, image-only self-attention) work on the kept subset unchanged. The
last block is context-pre-only (it returns no context), which needs nothing special.

Timestep: the model embeds timesteps on the scheduler's scale, sigma * 1000, so flow time t maps to 1000 t.
"""

from __future__ import annotations

from backbones.adapters.common import RoutedTransformer, Step, Stream, refuse_ip_adapter, run_block, split_cond, unpatchify


class SD3Adapter(RoutedTransformer):
    """cond: encoder_hidden_states (B, L, joint_attention_dim), pooled_projections (B, pooled_projection_dim),
    and optionally joint_attention_kwargs, force_keep."""

    family, model_class = "sd3", "SD3Transformer2DModel"

    def build_steps(self):
        m = self.model

        def call(block, x, s: Stream):
            s.text, x = run_block(m, block, x, s.text, s.temb, s.extra["attention"])
            return x

        return [Step(b, call, "joint") for b in m.transformer_blocks]

    def embed(self, x, t, cond):
        m = self.model
        p = self.patch
        refuse_ip_adapter(cond.get("joint_attention_kwargs"), "joint_attention_kwargs")
        tokens = m.pos_embed(x).contiguous()  # (B, N, D), absolute positions already added
        temb = m.time_text_embed(t * 1000, cond["pooled_projections"])
        text = m.context_embedder(cond["encoder_hidden_states"])  # (B, L, D)
        stream = Stream(temb, tokens.shape[1], text=text, extra={"attention": cond.get("joint_attention_kwargs")})
        return tokens, stream, (x.shape[-2] // p, x.shape[-1] // p)

    def head(self, tokens, stream, grid):
        out = self.model.proj_out(self.model.norm_out(tokens, stream.temb))  # (B, N, p * p * C)
        return unpatchify(out, grid, self.patch, channels_last=True)

    def oracle(self, x, t, cond=None, **kwargs):
        cond, _ = split_cond(cond, kwargs)
        refuse_ip_adapter(cond.get("joint_attention_kwargs"), "joint_attention_kwargs")
        t = t.reshape(-1).expand(x.shape[0])
        return self.model(
            x, encoder_hidden_states=cond["encoder_hidden_states"], pooled_projections=cond["pooled_projections"],
            timestep=t * 1000, joint_attention_kwargs=cond.get("joint_attention_kwargs"), return_dict=False,
        )[0]
