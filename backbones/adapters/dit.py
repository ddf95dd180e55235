"""DiTTransformer2DModel (facebook/DiT, class-conditional) under TREAD routing.

Absolute 2-D sin-cos positions are added in the patch embedding, before the blocks, so gathered tokens keep
them. Every DiT block embeds (timestep, class) in its own adaLN-Zero layer, so a block needs only the raw
timestep and labels, which the stream carries. In training mode diffusers' label embedding drops labels
with probability 0.1 using the global torch RNG, independently in every block; that is the model's behaviour
and is kept, unless `keep_labels(model)` turns it off for a trainer that drops labels itself.

Output: the first C channels (DiT predicts noise and a learned variance), used as the velocity when
fine-tuning with `edm.FlowLoss` (t -> 1000 t). cond: the class labels (B,) long, or {"class_labels": ...}.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from backbones.adapters.common import RoutedTransformer, Step, Stream, run_block, split_cond, unpatchify


class DiTAdapter(RoutedTransformer):
    family, model_class = "dit", "DiTTransformer2DModel"

    def conditioning(self, cond, kwargs):
        if torch.is_tensor(cond):
            cond = {"class_labels": cond}
        return split_cond(cond, kwargs)

    def build_steps(self):
        m = self.model

        def call(block, x, s: Stream):
            return run_block(m, block, x, None, None, None, s.extra["timestep"], s.extra["attention"], s.extra["labels"])

        return [Step(b, call, "adaLN-Zero") for b in m.transformer_blocks]

    def embed(self, x, t, cond):
        p = self.patch
        tokens = self.model.pos_embed(x)  # (B, N, D), absolute positions already added
        extra = {"timestep": t * 1000, "labels": cond["class_labels"], "attention": cond.get("cross_attention_kwargs")}
        return tokens, Stream(None, tokens.shape[1], extra=extra), (x.shape[-2] // p, x.shape[-1] // p)

    def head(self, tokens, stream, grid):
        m = self.model
        e = stream.extra
        # As the model: the output modulation comes from the first block's (timestep, class) embedding.
        c = m.transformer_blocks[0].norm1.emb(e["timestep"], e["labels"], hidden_dtype=tokens.dtype)
        shift, scale = m.proj_out_1(F.silu(c)).chunk(2, dim=1)
        out = m.proj_out_2(m.norm_out(tokens) * (1 + scale[:, None]) + shift[:, None])  # (B, N, p * p * C_out)
        return unpatchify(out, grid, self.patch, channels_last=True)[:, : m.config.in_channels]

    def oracle(self, x, t, cond=None, **kwargs):
        cond, _ = self.conditioning(cond, kwargs)
        t = t.reshape(-1).expand(x.shape[0])
        out = self.model(
            x, timestep=t * 1000, class_labels=cond["class_labels"],
            cross_attention_kwargs=cond.get("cross_attention_kwargs"), return_dict=False,
        )[0]
        return out[:, : self.model.config.in_channels]


def keep_labels(model) -> None:
    """Turn off diffusers' own label dropout: the trainer drops labels itself, once per sample and seeded.

    diffusers' DiT draws a fresh drop in every block's label embedding from the global RNG, so one sample would
    see its label in some blocks and the null class in others, on top of the trainer's drop. The embedding
    table keeps its null row (index num_embeds_ada_norm), which the trainer's drops and CFG use.
    """
    for module in model.modules():
        if type(module).__name__ == "LabelEmbedding":
            module.dropout_prob = 0.0
