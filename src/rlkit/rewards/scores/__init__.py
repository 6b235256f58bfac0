"""Built-in rule-based ``compute_score`` functions (veRL's contract).

Each module exposes ``compute_score(data_source, solution_str, ground_truth, extra_info=None)``
returning a float. They import only the standard library, so registering them is cheap.
"""
