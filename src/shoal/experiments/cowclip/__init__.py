"""CowClip's click-through-rate experiment (Zheng et al. 2022, arXiv 2204.06240): a CTR model as a user writes it,
synthetic click data with a planted signal, and the AUC it is scored by (ctr.py). The optimizer itself is
shoal.optim.cowclip; bench/cowclip_ctr.py trains this model through the public API at batch 1K to 64K."""
