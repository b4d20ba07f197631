"""The reward front: HTTP endpoints for RL frameworks that ask a URL for rewards (slime's
``--rm-url``, OpenRLHF's ``--remote_rm_url``), each request scored by ``infer`` actions on a
pooled reward service."""
