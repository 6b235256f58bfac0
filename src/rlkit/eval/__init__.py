"""Evaluation: the metrics training's validation and ``rlkit eval`` share (``rlkit.eval.metrics``), the model
kinds ``rlkit eval`` reads (``rlkit.eval.model``), its resumable loop (``rlkit.eval.loop``) and its reports
(``rlkit.eval.report``). docs/eval.md."""
