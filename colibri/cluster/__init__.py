"""Experts sharded across machines on Ray (`colibri run|chat|serve STORE --cluster ADDRESS`).

placement.py: which owner holds each (layer, expert) record (no Ray). owner.py: ExpertOwner,
one shard's IO stack and expert kernels (no Ray). client.py: ClusterExperts, the coordinator's
per-layer expert-FFN provider over Ray actors running ExpertOwners (imports Ray when a cluster
is opened). Ray is the optional extra `colibri[cluster]`; nothing else in colibri imports it.
"""
