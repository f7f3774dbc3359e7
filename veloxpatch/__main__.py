"""``python -m veloxpatch``: the same command line as ``veloxpatch`` (e.g. under ``mlx.launch``)."""

from .cli import main

if __name__ == "__main__":
    main(prog_name="veloxpatch")
