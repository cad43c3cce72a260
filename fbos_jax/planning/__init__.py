"""Plans of a config against hardware it does not own, in four modules:

* :mod:`.hardware`: topologies without the hardware, chip figures, HBM, analytic
  FLOPs and the roofline;
* :mod:`.programs`: the programs of a step, planned: the abstract memory plan
  (``launch/train.py --dry_run``) and every program compiled for a topology
  (``--dry_run --topology=v5p:2x4x4``), the compile set, the micro-batch search;
* :mod:`.engine`: the continuous engine's programs as abstract (jitted fn, args);
* :mod:`.async_split`: the asynchronous system's split plan and modelled speedup.
"""
