"""FluxTransformer2DModel (FLUX.1 dev/schnell and Flux-shaped models) under TREAD routing.

The stack the Router indexes is the model's double-stream blocks followed by its single-stream blocks
(FLUX.1: 19 + 38 = 57, so `end_layer_idx: -2` is the 37th single block). Only image tokens are routed:
- double-stream blocks keep the text stream whole and update it every block, routed or not;
- single-stream blocks receive text and image separately and concatenate them themselves, so the text
  tokens are always all there;
- rotary positions: the table of the full [text, image] sequence is computed once, as the model does it,
  and inside a route each kept image token gets the row of its original position (text rows unchanged).
  That table differs per sample, which diffusers' Flux attention cannot take (it broadcasts one (S, D)
  table over the batch), so the adapter installs `PerSampleRopeProcessor` on every Flux attention: with
  an (S, D) table it calls the original processor unchanged; with a (B, S, D) table it runs the same
  projections, norms and attention with the per-sample rotation.

Latents are packed 2x2 into tokens as FluxPipeline does (16 latent channels -> 64 features); position ids
are the pipeline's (row, column) ids on the packed grid, and text ids are zeros, unless given in `cond`.
"""

from __future__ import annotations

import torch

from backbones.adapters.common import RoutedTransformer, Step, Stream, patchify, refuse_ip_adapter, run_block, split_cond, unpatchify
from routing import ConfigError


def image_ids(h: int, w: int, device) -> torch.Tensor:
    """(h*w, 3) ids of the packed latent grid as FluxPipeline makes them: (0, row, column), raster order."""
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack([torch.zeros_like(rows), rows, cols], -1).reshape(h * w, 3).float().to(device)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Flux's rotary rotation with a per-sample table: x (B, S, H, Dh), cos/sin (B, S, Dh).

    Flux rotates interleaved pairs (x0, x1) -> (x0 cos - x1 sin, x1 cos + x0 sin), in fp32.
    """
    real, imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)  # (B, S, H, Dh/2) each
    turned = torch.stack([-imag, real], dim=-1).flatten(3)  # (B, S, H, Dh)
    return (x.float() * cos[:, :, None] + turned.float() * sin[:, :, None]).to(x.dtype)


class PerSampleRopeProcessor:
    """Flux attention that also accepts a per-sample rotary table; otherwise the original processor.

    Both paths attend through diffusers' attention dispatch with the backend chosen for the model
    (`model.set_attention_backend(...)` sets it on this wrapper, which keeps it on the original processor).
    """

    def __init__(self, inner):
        self.inner = inner

    @property
    def _attention_backend(self):
        return getattr(self.inner, "_attention_backend", None)

    @_attention_backend.setter
    def _attention_backend(self, backend):
        self.inner._attention_backend = backend

    @property
    def _parallel_config(self):
        return getattr(self.inner, "_parallel_config", None)

    @_parallel_config.setter
    def _parallel_config(self, config):
        self.inner._parallel_config = config

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None, **kwargs):
        if image_rotary_emb is None or image_rotary_emb[0].ndim == 2:
            return self.inner(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb, **kwargs)
        if kwargs or getattr(attn, "fused_projections", False) or type(self.inner).__name__ != "FluxAttnProcessor":
            raise ConfigError(
                f"routing Flux needs its default attention ({type(self.inner).__name__} with {sorted(kwargs)} given, "
                "fused projections off); unfuse QKV and drop IP-adapter inputs, or train without routes."
            )
        from diffusers.models import attention_dispatch

        def heads(u):
            return u.unflatten(-1, (-1, attn.head_dim))  # (B, S, H * Dh) -> (B, S, H, Dh)

        q = attn.norm_q(heads(attn.to_q(hidden_states)))
        k = attn.norm_k(heads(attn.to_k(hidden_states)))
        v = heads(attn.to_v(hidden_states))
        if attn.added_kv_proj_dim is not None:
            # Joint attention: the text stream's projections go first, as in the model's sequence order.
            q = torch.cat([attn.norm_added_q(heads(attn.add_q_proj(encoder_hidden_states))), q], dim=1)
            k = torch.cat([attn.norm_added_k(heads(attn.add_k_proj(encoder_hidden_states))), k], dim=1)
            v = torch.cat([heads(attn.add_v_proj(encoder_hidden_states)), v], dim=1)
        cos, sin = image_rotary_emb  # (B, S, Dh) each
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        # The dispatch takes (B, S, H, Dh), as the model's own processor calls it.
        out = attention_dispatch.dispatch_attention_fn(q, k, v, attn_mask=attention_mask, backend=self._attention_backend,
                                                       parallel_config=self._parallel_config)
        out = out.flatten(2).to(q.dtype)  # (B, S, H, Dh) -> (B, S, H * Dh)
        if encoder_hidden_states is None:
            return out  # single-stream: the block applies its own output projection
        n_text = encoder_hidden_states.shape[1]
        text, image = out[:, :n_text], out[:, n_text:]
        image = attn.to_out[1](attn.to_out[0](image.contiguous()))
        return image, attn.to_add_out(text.contiguous())


class FluxAdapter(RoutedTransformer):
    """cond: encoder_hidden_states (B, L, joint_attention_dim), pooled_projections (B, pooled_projection_dim),
    and optionally guidance (float or (B,), for guidance-distilled models; default `self.guidance`, 1.0), img_ids, txt_ids,
    joint_attention_kwargs, force_keep."""

    family, model_class, patch = "flux", "FluxTransformer2DModel", 2
    # The distilled guidance a guidance-embedding model (FLUX.1-dev) gets when cond gives none: SimpleTuner's
    # training default 1.0; a trainer sets finetune.guidance, train.sample --flux-guidance.
    guidance: float = 1.0

    @property
    def latent_channels(self) -> int:
        return self.model.config.in_channels // 4  # 2x2 packing: 4 C features per token

    def build_steps(self):
        m = self.model
        if m.config.patch_size != 1:
            raise ConfigError(f"the Flux adapter packs latents 2x2 itself and needs patch_size=1, got {m.config.patch_size}.")
        self.install_processors()

        def call(block, x, s: Stream):
            # Double and single blocks share the signature (image, text, temb, rotary, kwargs) -> (text, image).
            s.text, x = run_block(m, block, x, s.text, s.temb, self.rotary(s, x.shape[1]), s.extra["attention"])
            return x

        return [Step(b, call, "double") for b in m.transformer_blocks] + [Step(b, call, "single") for b in m.single_transformer_blocks]

    def install_processors(self) -> None:
        """Wrap every Flux attention's processor (idempotent; re-run if the processors were replaced)."""
        for module in self.model.modules():
            processor = getattr(module, "processor", None)
            if type(module).__name__ == "FluxAttention" and not isinstance(processor, PerSampleRopeProcessor):
                module.set_processor(PerSampleRopeProcessor(processor))

    @staticmethod
    def rotary(s: Stream, k: int):
        """The rotary table for a block given k image tokens: (S, Dh) when all, else (B, L + k, Dh) per sample."""
        pos = s.positions(k)
        if pos is None:
            return s.extra["rotary"]
        if "rotary" not in s.cache:
            n_text = s.text.shape[1]
            b = pos.shape[0]
            table = []
            for full in s.extra["rotary"]:  # cos, then sin: (L + N, Dh)
                text = full[:n_text].expand(b, -1, -1)  # (B, L, Dh)
                image = full[n_text:][pos]  # (N, Dh)[(B, k)] -> (B, k, Dh): each kept token's own row
                table.append(torch.cat([text, image], dim=1))
            s.cache["rotary"] = tuple(table)
        return s.cache["rotary"]

    def inputs(self, x, t, cond):
        """The diffusers forward's inputs for (x, t, cond): packed tokens, ids, timestep and guidance."""
        m = self.model
        refuse_ip_adapter(cond.get("joint_attention_kwargs"), "joint_attention_kwargs")
        b, _, height, width = x.shape
        h, w = height // 2, width // 2
        text = cond["encoder_hidden_states"]
        img_ids = cond.get("img_ids")
        txt_ids = cond.get("txt_ids")
        img_ids = image_ids(h, w, x.device) if img_ids is None else img_ids
        txt_ids = torch.zeros(text.shape[1], 3, device=x.device) if txt_ids is None else txt_ids
        guidance = cond.get("guidance")
        if m.config.guidance_embeds:
            guidance = torch.as_tensor(self.guidance if guidance is None else guidance, device=x.device).float().reshape(-1).expand(b)
        else:
            guidance = None
        return dict(
            hidden_states=patchify(x, 2), encoder_hidden_states=text, pooled_projections=cond["pooled_projections"],
            timestep=t, img_ids=img_ids, txt_ids=txt_ids, guidance=guidance,
            joint_attention_kwargs=cond.get("joint_attention_kwargs"),
        ), (h, w)

    def embed(self, x, t, cond):
        m = self.model
        self.install_processors()
        args, grid = self.inputs(x, t, cond)
        # As FluxTransformer2DModel.forward: embed the image and text, the time (x1000) and pooled text.
        tokens = m.x_embedder(args["hidden_states"])  # (B, N, D)
        timestep = args["timestep"].to(tokens.dtype) * 1000
        if args["guidance"] is None:
            temb = m.time_text_embed(timestep, args["pooled_projections"])
        else:
            temb = m.time_text_embed(timestep, args["guidance"].to(tokens.dtype) * 1000, args["pooled_projections"])
        text = m.context_embedder(args["encoder_hidden_states"])  # (B, L, D)
        rotary = m.pos_embed(torch.cat([args["txt_ids"], args["img_ids"]], dim=0))  # cos, sin: (L + N, Dh)
        extra = {"rotary": rotary, "attention": args["joint_attention_kwargs"]}
        return tokens, Stream(temb, tokens.shape[1], text=text, extra=extra), grid

    def head(self, tokens, stream, grid):
        out = self.model.proj_out(self.model.norm_out(tokens, stream.temb))  # (B, N, 4 C)
        return unpatchify(out, grid, 2, channels_last=False)

    def oracle(self, x, t, cond=None, **kwargs):
        cond, _ = split_cond(cond, kwargs)
        args, grid = self.inputs(x, t.reshape(-1).expand(x.shape[0]), cond)
        out = self.model(**args, return_dict=False)[0]
        return unpatchify(out, grid, 2, channels_last=False)
