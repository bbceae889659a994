"""`python -m moetron` and `torchrun -m moetron` enter the same CLI as the `moetron` script."""

from moetron.launcher.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
