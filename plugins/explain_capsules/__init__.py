"""Capsule networks with dynamic routing and routing-entropy minimisation (REM).

Work in progress: layers, routing and the REM parse-tree statistics are here; models, training,
pruning, saliency and the plugin registration follow.
"""
