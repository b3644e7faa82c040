"""The `dspark` command line (entry point `dspark.cli:app`): one module per command group.

run.py (generate, profile, prepare), train.py (train, train-sanity, train-curve, eval, compare), bench.py
(`dspark bench ...`), ops.py (`dspark autoscale | ab | dashboard ...`), suffix.py (`dspark suffix ...`);
common.py holds the options and the output they share."""

from __future__ import annotations

import typer

from dspark.cli import run, train
from dspark.cli.bench import bench_app
from dspark.cli.ops import ab_app, autoscale_app, dashboard_app
from dspark.cli.suffix import suffix_app

app = typer.Typer(add_completion=False, no_args_is_help=True, help="DSpark speculative decoding.")
app.add_typer(bench_app, name="bench")
app.add_typer(autoscale_app, name="autoscale")
app.add_typer(ab_app, name="ab")
app.add_typer(dashboard_app, name="dashboard")
app.add_typer(suffix_app, name="suffix")
app.command()(run.generate)
app.command()(run.profile)
app.command()(train.train)
app.command("train-sanity")(train.train_sanity)
app.command("train-curve")(train.train_curve)
app.command("eval")(train.eval_cmd)
app.command("compare")(train.compare_cmd)
app.command()(run.prepare)


if __name__ == "__main__":
    app()
