"""``scaletrain compare``: the comparative evaluation of training strategies as one command.

The survey "How to Train Your Neural Network: A Comparative Evaluation" (Lin, Nichols, Singh,
Bhatele) compares data, tensor and pipeline parallel frameworks by time and its scaling, statistical
efficiency per step and per second, per-device memory and where the time goes. Here every strategy
runs in one runtime on the same data and models, so the study is a matrix of ``scaletrain train``
runs:

- :mod:`.matrix`: strategies, models with their fixed hyperparameters, the cells;
- :mod:`.runner`: runs the cells (subprocesses, interleaved repeats, resumable, statuses);
- :mod:`.predict`: the cost model's step time and peak for each cell;
- :mod:`.results`: results.json / results.csv, one run's figures from its metrics.jsonl;
- :mod:`.findings`: the survey's claims judged by rules on the cells;
- :mod:`.figures`, :mod:`.report`: the self-contained report.html;
- :mod:`.environment`: machine, versions, load and dates (study.json).
"""
