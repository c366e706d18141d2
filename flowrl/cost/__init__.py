"""The cost model: hardware profiles, per-op time and memory estimates, a discrete-event simulator.

Pure Python (no torch, numpy, Ray): ``flowrl plan`` and ``schedule auto`` use it and
must answer in milliseconds. Only ``flowrl profile`` (:func:`flowrl.cost.profiles.measure`)
imports torch, to measure the machine it runs on.
"""
