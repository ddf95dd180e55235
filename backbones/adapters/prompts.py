"""Class prompts for the text-conditioned adapters: integer class labels -> the family's text conditioning.

The trainer, the samplers and classifier-free guidance speak class labels; Flux, SD3 and PixArt take text
embeddings. A prompt table holds the text conditioning the model's own pipeline computed for one prompt per
class k = 0..K-1, and for the empty prompt in row K: the null class that label dropout and CFG use, as the
pipelines encode "" for their unconditional branch. `PromptConditioned(adapter, table)` looks up the rows of
a batch's labels and calls the adapter, so `FlowModel(PromptConditioned(...))` is called exactly as our own
backbones are: net(x, t, class_labels). It has no weights; the table rides along as non-persistent buffers,
so it follows the model to its device and never enters a checkpoint.

DiT takes class labels itself and needs no table.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from backbones.adapters.common import RoutedTransformer
from routing import ConfigError

# What each text family reads from a table: tensor name -> the model config key its last dimension must equal
# (None: not a width).
TABLE_KEYS = {
    "flux": {"encoder_hidden_states": "joint_attention_dim", "pooled_projections": "pooled_projection_dim"},
    "sd3": {"encoder_hidden_states": "joint_attention_dim", "pooled_projections": "pooled_projection_dim"},
    "pixart": {"encoder_hidden_states": "caption_channels", "encoder_attention_mask": None},
    "wan": {"encoder_hidden_states": "text_dim"},  # umT5's states, zero-padded to the pipeline's length by encode_prompt
}
# PixArt-alpha 1024 conditions on the image size in pixels, which its pipeline gives as latent size x 8 (its VAE).
PIXART_VAE_FACTOR = 8


class PromptConditioned(nn.Module):
    """f(x, t, class_labels) for a text-conditioned adapter, through a table of per-class text conditioning.

    `table`: tensor name -> (K + 1, ...) tensor, the names of TABLE_KEYS[family]; row K is the empty prompt.
    `on_device=False` keeps the table in host memory and moves only a batch's rows (a table of many captions).
    """

    def __init__(self, adapter: RoutedTransformer, table: Mapping[str, torch.Tensor], on_device: bool = True):
        super().__init__()
        if adapter.family not in TABLE_KEYS:
            raise ConfigError(f"the {adapter.family} adapter takes class labels itself; drop its prompt table.")
        self.adapter, self.names, self.on_device = adapter, tuple(TABLE_KEYS[adapter.family]), on_device
        self.use_table(table)

    def use_table(self, table: Mapping[str, torch.Tensor]) -> None:
        """Condition on `table` from now on (checked against the model); `train.sample --prompt` swaps in its prompts."""
        family, config = self.adapter.family, self.adapter.model.config
        wanted = TABLE_KEYS[family]
        missing = sorted(set(wanted) - set(table))
        if missing:
            raise ConfigError(f"the prompt table lacks {missing}, which {family} needs; write it with "
                              f"`python -m train.encode_prompts --family {family} ...`.")
        rows = table["encoder_hidden_states"].shape[0]
        for name, width in wanted.items():
            tensor = table[name]
            if tensor.shape[0] != rows:
                raise ConfigError(f"the prompt table's {name} has {tensor.shape[0]} rows, encoder_hidden_states {rows}; "
                                  "write the table again with python -m train.encode_prompts.")
            if width is not None and tensor.shape[-1] != config[width]:
                raise ConfigError(
                    f"the prompt table's {name} is {tensor.shape[-1]} wide, but this {self.adapter.model_class}'s {width} is "
                    f"{config[width]}; encode the prompts with this model's own pipeline (python -m train.encode_prompts)."
                )
        for name in wanted:
            if self.on_device:
                device = getattr(self, name).device if name in self._buffers else None
                self.register_buffer(name, table[name] if device is None else table[name].to(device), persistent=False)
            else:
                setattr(self, name, table[name])  # a plain attribute: .to(device) leaves it where it is
        self.num_classes = rows - 1  # row K is the empty prompt

    @property
    def router(self):
        return self.adapter.router

    @property
    def patch(self) -> int:
        return self.adapter.patch

    @property
    def depth(self) -> int:
        return self.adapter.depth

    @property
    def pretrained(self) -> nn.Module:
        return self.adapter.model

    def route_masks(self) -> list[torch.Tensor]:
        return self.adapter.route_masks()

    def forward(self, x: torch.Tensor, t: torch.Tensor, class_labels: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, C, H, W), t (B,) flow time, class_labels (B,) in 0..K (K: the empty prompt; None: all K)."""
        if class_labels is None:
            class_labels = torch.full((x.shape[0],), self.num_classes, dtype=torch.long, device=x.device)
        cond = {}
        for name in self.names:
            table = getattr(self, name)
            rows = table[class_labels.to(table.device)].to(x.device)  # (K + 1, ...)[(B,)] -> (B, ...)
            # A table stored in bf16 follows the inputs' dtype; the attention mask stays as it is.
            cond[name] = rows.to(x.dtype) if rows.is_floating_point() else rows
        model = self.adapter.model
        if getattr(model, "use_additional_conditions", False):
            # As PixArtAlphaPipeline: the image size in pixels and its aspect ratio, per sample.
            h, w = x.shape[-2] * PIXART_VAE_FACTOR, x.shape[-1] * PIXART_VAE_FACTOR
            cond["added_cond_kwargs"] = {
                "resolution": torch.tensor([[h, w]], dtype=x.dtype, device=x.device).expand(x.shape[0], 2),
                "aspect_ratio": torch.tensor([[h / w]], dtype=x.dtype, device=x.device).expand(x.shape[0], 1),
            }
        return self.adapter(x, t, cond)
