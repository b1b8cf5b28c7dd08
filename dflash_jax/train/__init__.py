"""Drafter training and small-LM pretraining: the objective (`objective`), data (`data`), the loops
(`loop`) and the `dflash-jax train-drafter` command (`cli`)."""
from dflash_jax.train.cli import add_cli
from dflash_jax.train.data import check_token_stream, corpus_files, load_corpus, sample_anchors, sample_windows
from dflash_jax.train.loop import (
    COMPUTE_DTYPES,
    LABELS,
    TrainConfig,
    evaluate_drafter,
    evaluate_target,
    init_drafter,
    init_target,
    make_optimizer,
    param_count,
    pretrain_target,
    train_drafter,
    write_log,
)
from dflash_jax.train.objective import (
    acceptance_length,
    drafter_loss,
    lm_loss,
    loss_weights,
    selector_ce,
    weighted_block_ce,
)

__all__ = [
    "COMPUTE_DTYPES", "LABELS", "TrainConfig", "acceptance_length", "add_cli", "check_token_stream", "corpus_files",
    "drafter_loss", "evaluate_drafter", "evaluate_target", "init_drafter", "init_target", "lm_loss", "load_corpus",
    "loss_weights", "make_optimizer", "param_count", "pretrain_target", "sample_anchors", "sample_windows",
    "selector_ce", "train_drafter", "weighted_block_ce", "write_log",
]
