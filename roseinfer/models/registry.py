"""model_type -> model class."""
from __future__ import annotations

from torch import nn

from roseinfer.distributed.parallel import SINGLE, TensorParallel
from roseinfer.models.config import GEMMA_FAMILY, HYBRID_FAMILY, LLAMA_FAMILY, MOE_FAMILY, ModelConfig
from roseinfer.models.deepseek import DeepseekForCausalLM
from roseinfer.models.deepseek_config import DEEPSEEK_FAMILY
from roseinfer.models.gemma import GemmaForCausalLM
from roseinfer.models.gpt2 import GPT2LMHeadModel
from roseinfer.models.gpt_oss import GptOssForCausalLM
from roseinfer.models.gpt_oss_config import GPT_OSS_FAMILY
from roseinfer.models.llama import LlamaForCausalLM
from roseinfer.models.moe_llama import MoeForCausalLM
from roseinfer.models.qwen3_5 import Qwen3_5ForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {"gpt2": GPT2LMHeadModel}
MODEL_CLASSES.update({name: LlamaForCausalLM for name in LLAMA_FAMILY})
MODEL_CLASSES.update({name: MoeForCausalLM for name in MOE_FAMILY})
MODEL_CLASSES.update({name: GemmaForCausalLM for name in GEMMA_FAMILY})
MODEL_CLASSES.update({name: DeepseekForCausalLM for name in DEEPSEEK_FAMILY})
MODEL_CLASSES.update({name: Qwen3_5ForCausalLM for name in HYBRID_FAMILY})
MODEL_CLASSES.update({name: GptOssForCausalLM for name in GPT_OSS_FAMILY})


def build_model(cfg: ModelConfig, tp: TensorParallel = SINGLE) -> nn.Module:
    """The model for cfg, as rank tp.rank of tp.size holds it (whole at size 1)."""
    if cfg.model_type not in MODEL_CLASSES:
        raise ValueError(f"unsupported model_type {cfg.model_type!r}; supported: {', '.join(MODEL_CLASSES)}")
    return MODEL_CLASSES[cfg.model_type](cfg, tp)
