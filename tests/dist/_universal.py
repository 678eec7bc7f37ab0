"""DeepSpeed's documented conversion to a universal checkpoint, the oracle of the reshard tests."""


def ds_to_universal(src: str, dst: str) -> None:
    """``python -m deepspeed.checkpoint.ds_to_universal --input_folder SRC --output_folder DST
    --inject_missing_state --num_extract_workers 1 --num_merge_workers 1`` (``--inject_missing_state`` for a
    non-Megatron client): its ``main`` with those arguments, called in a forked rank that has DeepSpeed imported
    already (a cold interpreter would import it again), its output swallowed."""
    import argparse
    import contextlib
    import io

    from deepspeed.checkpoint.ds_to_universal import main
    args = argparse.Namespace(input_folder=src, output_folder=dst, num_extract_workers=1, num_merge_workers=1,
                              keep_temp_folder=False, strict=True, inject_missing_state=True)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        main(args)
