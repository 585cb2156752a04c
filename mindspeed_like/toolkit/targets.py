"""megatron's module paths, in one place: every patch names its target from these.

Module paths only (a patch adds ``.Class.method``); where a module moved between megatron-core
releases, both paths are here with the versions each holds. Nothing is imported.
"""

CORE = "megatron.core"

# transformer
TRANSFORMER_CONFIG = f"{CORE}.transformer.transformer_config"
TRANSFORMER_LAYER = f"{CORE}.transformer.transformer_layer"
TORCH_NORM = f"{CORE}.transformer.torch_norm"
MLP = f"{CORE}.transformer.mlp"
DOT_PRODUCT_ATTENTION = f"{CORE}.transformer.dot_product_attention"
ATTENTION = f"{CORE}.transformer.attention"
TRANSFORMER_UTILS = f"{CORE}.transformer.utils"
MOE = f"{CORE}.transformer.moe"
MOE_EXPERTS = f"{MOE}.experts"
MOE_UTILS = f"{MOE}.moe_utils"
MOE_ROUTER = f"{MOE}.router"
MOE_TOKEN_DISPATCHER = f"{MOE}.token_dispatcher"
GROUPED_GEMM_UTIL = f"{MOE}.grouped_gemm_util"

# kernels megatron fuses
TE_EXTENSION = f"{CORE}.extensions.transformer_engine"  # megatron's TE bindings (None without TE)
FUSED_BIAS_SWIGLU = f"{CORE}.fusions.fused_bias_swiglu"
ROPE_UTILS = f"{CORE}.models.common.embeddings.rope_utils"
ROTARY_EMBEDDING = f"{CORE}.models.common.embeddings.rotary_pos_embedding"

# models
GPT_MODEL = f"{CORE}.models.gpt.gpt_model"
LANGUAGE_MODULE = f"{CORE}.models.common.language_module.language_module"

# tensor parallel
TP_RANDOM = f"{CORE}.tensor_parallel.random"
TP_LAYERS = f"{CORE}.tensor_parallel.layers"
TP_MAPPINGS = f"{CORE}.tensor_parallel.mappings"
TP_UTILS = f"{CORE}.tensor_parallel.utils"
CORE_UTILS = f"{CORE}.utils"

# optimizers and data parallel
OPTIMIZER = f"{CORE}.optimizer.optimizer"
DISTRIB_OPTIMIZER = f"{CORE}.optimizer.distrib_optimizer"
CLIP_GRADS = f"{CORE}.optimizer.clip_grads"
GRAD_SCALER = f"{CORE}.optimizer.grad_scaler"
DDP = f"{CORE}.distributed.distributed_data_parallel"
PARAM_AND_GRAD_BUFFER = f"{CORE}.distributed.param_and_grad_buffer"

# pipeline parallel
SCHEDULES = f"{CORE}.pipeline_parallel.schedules"
P2P = f"{CORE}.pipeline_parallel.p2p_communication"

# checkpointing and data
DIST_CHECKPOINTING = f"{CORE}.dist_checkpointing"
CHECKPOINT_STRATEGIES = f"{DIST_CHECKPOINTING}.strategies"
DATASETS_UTILS = f"{CORE}.datasets.utils"

# Megatron-LM's training loop (a checkout of Megatron-LM; inside the wheel from 0.17)
TRAINING = "megatron.training"
TRAINING_ARGUMENTS = f"{TRAINING}.arguments"
TRAINING_INITIALIZE = f"{TRAINING}.initialize"
TRAINING_LOOP = f"{TRAINING}.training"
TRAINING_UTILS = f"{TRAINING}.utils"
TRAINING_CHECKPOINTING = f"{TRAINING}.checkpointing"
LEGACY_FUSED_KERNELS = "megatron.legacy.fused_kernels"
