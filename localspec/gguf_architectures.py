"""What llama.cpp knows of each model architecture, as the llama.cpp that llama-cpp-python 0.3.36
vendors has it (``src/llama-arch.cpp`` and the graph builders in ``src/models/``): the names it
loads, and the hyperparameters its builders assert on, which abort the process where a file
breaks them. ``gguf_meta`` refuses such files before llama.cpp sees them. Taken from that
source when the pinned version changes; an architecture missing here is one that version does
not know.
"""

from __future__ import annotations

# LLM_ARCH_NAMES: every architecture llama.cpp loads (another is "unknown model architecture").
KNOWN = frozenset({
    "clip", "llama", "llama4", "deci", "falcon", "grok", "gpt2", "gptj", "gptneox", "mpt",
    "baichuan", "starcoder", "refact", "bert", "modern-bert", "nomic-bert", "nomic-bert-moe",
    "neo-bert", "jina-bert-v2", "jina-bert-v3", "eurobert", "bloom", "stablelm", "qwen",
    "qwen2", "qwen2moe", "qwen2vl", "qwen3", "qwen3moe", "qwen3next", "qwen3vl", "qwen3vlmoe",
    "qwen35", "qwen35moe", "qwen4exp", "phi2", "phi3", "phimoe", "plamo", "plamo2", "plamo3",
    "codeshell", "orion", "internlm2", "minicpm", "minicpm3", "gemma", "gemma2", "gemma3",
    "gemma3n", "gemma4", "gemma4-assistant", "gemma-embedding", "starcoder2", "mamba", "mamba2",
    "maple", "jamba", "falcon-h1", "xverse", "command-r", "cohere2", "cohere2moe", "dbrx",
    "olmo", "olmo2", "olmoe", "muse-glimmer", "openelm", "arctic", "deepseek", "deepseek2",
    "deepseek2-ocr", "deepseek32", "deepseek4", "chatglm", "glm4", "glm4moe", "glm-dsa",
    "bitnet", "t5", "t5encoder", "jais", "jais2", "nemotron", "nemotron_h", "nemotron_h_moe",
    "exaone", "exaone4", "exaone-moe", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7", "granite",
    "granitemoe", "granitehybrid", "graniteswitch", "granite_swa", "chameleon",
    "wavtokenizer-dec", "plm", "bailingmoe", "bailingmoe2", "bailingmoe3", "dots1", "dots3note",
    "arcee", "afmoe", "laguna", "ernie4_5", "ernie4_5-moe", "hunyuan-moe", "hunyuan-dense",
    "hunyuan_vl", "hy_v3", "hy_v4", "smollm3", "gpt-oss", "lfm2", "lfm2moe", "dream",
    "smallthinker", "llada", "llada-moe", "seed_oss", "grovemoe", "apertus", "minimax-01",
    "hrm_text", "minimax-m2", "minimax-m3", "cogvlm", "rnd1", "pangu-embedded", "mistral3",
    "eagle3", "dflash", "mistral4", "paddleocr", "mimo2", "step35", "spark2_5", "llama-embed",
    "maincoder", "kimi-linear", "kimi-k3", "glm5-next", "talkie", "mellum", "nanbeige",
    "qwen3tts", "pockettts"})

# Builders asserting that the RoPE dimension is the head size (an uncommented
# GGML_ASSERT(n_embd_head == n_rot)); the others rotate part of each head.
ROPE_IS_HEAD = frozenset({
    "apertus", "arcee", "arctic", "baichuan", "chameleon", "codeshell", "cogvlm", "cohere2moe",
    "dbrx", "deci", "deepseek", "dots1", "dream", "ernie4_5", "ernie4_5-moe", "exaone",
    "exaone-moe", "exaone4", "falcon", "granite", "granite_swa", "graniteswitch", "grok",
    "grovemoe", "hunyuan-moe", "hunyuan_vl", "hy_v3", "internlm2", "jais2", "llada",
    "llada-moe", "llama", "llama4", "maincoder", "mellum", "mistral3", "olmo", "olmo2", "olmoe",
    "orion", "paddleocr", "pangu-embedded", "plamo", "pockettts", "qwen2", "qwen2moe",
    "qwen2vl", "qwen3", "qwen3moe", "qwen3vl", "qwen3vlmoe", "rnd1", "seed_oss", "smallthinker",
    "smollm3", "starcoder2", "talkie", "xverse"})

# Builders asserting that keys and values have one head size
# (GGML_ASSERT(n_embd_head == hparams.n_embd_head_k()) and the like), and those above.
KEY_IS_VALUE = ROPE_IS_HEAD | frozenset({
    "afmoe", "bailingmoe2", "bert", "bitnet", "bloom", "chatglm", "cohere2", "command-r",
    "dflash", "eagle3", "eurobert", "glm4", "glm4moe", "gpt2", "gptneox", "granitehybrid",
    "jais", "laguna", "maple", "minimax-01", "minimax-m2", "minimax-m3", "modern-bert", "mpt",
    "muse-glimmer", "nanbeige", "nemotron", "nemotron_h", "neo-bert", "openelm", "phi2", "phi3",
    "qwen", "qwen35", "qwen35moe", "qwen3next", "qwen4exp", "refact", "spark2_5", "stablelm",
    "starcoder", "t5"})
