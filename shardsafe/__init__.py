"""shardsafe: in-memory, erasure-coded fault tolerance for DeepSpeed and Megatron pretraining.

Importing the package imports nothing else: the activation hook (site-packages/shardsafe-autoload.pth) imports
it in every interpreter, so it stays this one assignment (pyproject.toml reads the version from here).
"""
__version__ = "0.1.0"
