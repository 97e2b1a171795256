"""Expert affinity (Sem-MoE's model placement on afore's primary layout).

  profile.py      AffinityProfile: per-layer token-expert and expert-expert co-activation (.npz)
  token_model.py  TokenModel: per-token top-k routing drawn from a class mixture (traces -> tokens)
  olmoe.py        the OLMoE routing-analysis CSVs (../shared/traces/olmoe) as token models
  cocluster.py    F balanced expert sets -> primaries: fanout_cluster (fewest FFN workers per token),
                  co_cluster (Sem-MoE's in-set co-activation)
  fanout.py       FFN workers and bytes per token under a primary layout or a plan (sparse dispatch),
                  and the lower bound any primary layout has on a token model
  cli.py          `afore profile affinity`
"""
