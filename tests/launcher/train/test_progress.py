"""The console away from a terminal (CI, Slurm logs): one line per logged step."""

import io

from moetron.launcher.train.progress import Progress


def test_log_lines_show_val_loss_only_where_it_was_evaluated():
    stream = io.StringIO()
    with Progress(total=30, stream=stream) as progress:
        progress.update(10, {"loss": 2.5, "tokens_per_s": 1000.0, "val_loss": 2.25})
        progress.update(20, {"loss": 2.0, "tokens_per_s": 1100.0})
        progress.update(25, {"loss": 1.9})  # neither logged nor evaluated: no line
        progress.update(30, {"loss": 1.5, "tokens_per_s": 1200.0, "val_loss": 1.75})
    lines = stream.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == ["10/30", "20/30", "30/30"]
    assert "val_loss 2.25" in lines[0] and "val_loss" not in lines[1] and "val_loss 1.75" in lines[2]
    assert "loss 2 " in lines[1] and "1,100 tok/s" in lines[1]
