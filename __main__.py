"""`python -m moetron` and `torchrun -m moetron` enter the same CLI as the `moetron` script."""

import signal

if __name__ == "__main__":
    # Slurm's checkpoint signal (SIGUSR1) may arrive while a rank still imports torch or waits for
    # its peers; its default action would kill the rank with nothing saved. Held pending from the
    # first line until the training loop installs its handler (launcher/train/trainer.py, StopFlag).
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})

    from moetron.launcher.cli.main import main

    raise SystemExit(main())
