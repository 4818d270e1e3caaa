# Overlay for any base config, given last: every phase in 150 steps with the base's proportions
# (schedule_scale), a check that things run, not a result.
#   python train.py config/tinystories_all_taper.py config/cpu.py config/smoke.py   # CPU, austen: about a minute
#   python train.py config/tinystories_all_taper.py config/smoke.py                 # TinyStories (GPU)
# After cpu.py (1500 steps): gate warmup 15, taper 75, linear 60; the learning rate decays over the 150.
# schedule_scale multiplies every step count, those given as --key=value too (--eval_interval=50 runs
# every 5 steps here); the line under the run's header prints the counts the run uses.
_overlay = 2            # configurator: given last (after config/cpu.py); other orders are refused

schedule_scale = 150 / max_iters  # the base's max_iters, read from the files before this one
eval_iters = 5
out_dir = 'out-smoke-{dataset}-{taper}-aux{aux_weight:g}'
