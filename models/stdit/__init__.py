"""Open-Sora STDiT3-style (1.2/1.3): a spatial and a temporal block per layer, cross-attention to the text."""
from __future__ import annotations

from models.diffusion import PER_SAMPLE
from models.shared.pipeline import T5, CogVideoXLatents
from models.spec import Costs, FamilySpec, Formats, Network, Sampling, Wording
from models.stdit.config import STDiTConfig
from models.stdit.model import EmbedStage, FinalStage, STDiT3Layer


def attention_pairs(m: STDiTConfig, grid: tuple[int, int, int]) -> int:
    """Spatial t (hw)^2 + temporal hw t^2 + two cross-attentions (one per block) 2 t hw L."""
    t, h, w = grid
    return t * (h * w) ** 2 + h * w * t ** 2 + 2 * t * h * w * m.max_text_len


SPEC = FamilySpec(
    name="stdit",
    config=STDiTConfig,
    network=Network(
        embed=EmbedStage,
        layer=STDiT3Layer,
        final=FinalStage,
        recompute_parts={"attention": ("spatial.attn.core", "temporal.attn.core"),
                         "mlp": ("spatial.mlp", "temporal.mlp")},
    ),
    costs=Costs(
        text_in_sequence=False,
        row_parallel_per_layer=6,                # self-attention, cross-attention and MLP outputs of two blocks
        attention_pairs=attention_pairs,
        attentions_per_layer=2,                  # a spatial and a temporal self-attention
    ),
    wording=Wording(
        describe_layers=lambda m: f"{m.num_layers} layers ({m.num_layers} spatial + {m.num_layers} temporal blocks)",
        layer_noun="layer",
    ),
    formats=Formats(
        # Trained here on CogVideoX's VAE latents and T5 embeddings (Open-Sora's own VAE is not in diffusers).
        vae=CogVideoXLatents(),
        text_encoder=T5,
        released=None,                           # no diffusers release: exports in the toolkit's format
    ),
    timesteps=PER_SAMPLE,
    sampling=Sampling(samplers={"v_prediction": ("ddim", "dpm"), "flow_matching": ("euler", "flow_euler", "unipc")},
                      scheduler=None),
)
