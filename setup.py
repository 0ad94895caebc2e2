"""Packaging for megatron_lrattn.

torch is deliberately not a hard requirement: on a machine without it, an unpinned
``torch`` pulls a multi-GB CUDA build. Install torch first (see README.md).
"""
from setuptools import find_packages, setup

setup(
    name="megatron_lrattn",
    version="0.1.0",
    description="Low-Rank Attention Residuals (LR-AttnRes) for Megatron-core pretraining",
    python_requires=">=3.11",
    packages=find_packages(include=["megatron_lrattn", "megatron_lrattn.*"]),
    install_requires=[
        "megatron-core>=0.16.1,<0.20",
        "tokenizers>=0.20",
        "safetensors>=0.4",
        "transformers>=4.45",
        "tqdm",
        "psutil",
        "pyyaml",
        "numpy<2.4",
    ],
    extras_require={
        "triton": ["triton>=3.2"],
        "plots": ["matplotlib>=3.7"],
        # lm-evaluation-harness with its Hugging Face model backend (docs/eval.md).
        "lm_eval": ["lm-eval[hf]>=0.4"],
        # The tests draw the plots and run the kernels under TRITON_INTERPRET=1.
        "test": ["pytest", "hypothesis", "triton>=3.2,<3.7", "matplotlib>=3.7"],
    },
    entry_points={
        "console_scripts": [
            "lrattn-pretrain=megatron_lrattn.cli.pretrain:main",
            "lrattn-preprocess=megatron_lrattn.cli.preprocess:main",
            "lrattn-flops=megatron_lrattn.cli.flops:main",
            "lrattn-plan=megatron_lrattn.cli.plan:main",
            "lrattn-convert-hf=megatron_lrattn.cli.convert_hf:main",
            "lrattn-convert-megatron=megatron_lrattn.cli.convert_megatron:main",
            "lrattn-profile=megatron_lrattn.cli.profile:main",
            "lrattn-analyze=megatron_lrattn.cli.analyze:main",
            "lrattn-eval=megatron_lrattn.cli.eval:main",
        ],
    },
)
