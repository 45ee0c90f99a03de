"""MoEConfig: the errors for bad, mistyped and removed fields."""

import pytest
import torch

from layer_helpers import _config

@pytest.mark.parametrize("kwargs,pattern", [
    (dict(top_k=9), r"top_k=9 exceeds num_experts=8; lower top_k"),
    (dict(top_k=0), r"top_k=0: must be a positive int"),
    (dict(top_k=2, ep_size=3), r"num_experts=8 is not divisible by ep_size=3"),
    (dict(top_k=2, activation="tanh"), r"activation='tanh': use one of"),
    (dict(top_k=2, score_func="tanh"), r"score_func='tanh'"),
    (dict(top_k=2, capacity_factor=0.0), r"capacity_factor=0.0: must be > 0, or None"),
    (dict(top_k=2, drop_policy="random"), r"drop_policy='random'"),
    (dict(top_k=2, shared_intermediate_size=4), r"num_shared_experts=0; set num_shared_experts >= 1"),
    (dict(top_k=2, backend="cuda"), r"backend='cuda'"),
    (dict(top_k=2, router_dtype=torch.int32), r"router_dtype=torch.int32: use a float dtype"),
    (dict(top_k=2, aux_loss_coef=-1.0), r"aux_loss_coef=-1.0: must be >= 0"),
    (dict(top_k=2, dispatch="bogus"),
     r"dispatch='bogus': use one of \('auto', 'all_to_all', 'all_gather', 'all_gather_copy_engine'\)"),
    # removed fields (a config file or --set written for an older version) name their replacement
    (dict(top_k=2, transport="copy_engine"),
     r"^MoEConfig.transport no longer exists: .*dispatch='all_gather_copy_engine'"),
    (dict(top_k=2, dispatch="all_gather", transport="nccl"), r"^MoEConfig.transport no longer exists"),
    (dict(top_k=2, own_rows_first=True), r"^MoEConfig.own_rows_first no longer exists: .*drop it"),
    (dict(top_k=2, own_rows_first=False), r"^MoEConfig.own_rows_first no longer exists"),
    (dict(top_k=2, overlap_chunks=2), r"^MoEConfig.overlap_chunks no longer exists: .*drop it"),
    (dict(top_k=2, overlap_chunks=1), r"^MoEConfig.overlap_chunks no longer exists"),
    (dict(top_k=2, dispatch="all_gather", all_gather_row_bound=0.0), r"all_gather_row_bound=0.0: must be > 0"),
    # wrong types (e.g. strings from a config file or --set), before any comparison
    (dict(top_k=2, capacity_factor="1.25"), r"capacity_factor='1.25': must be a finite number, or None"),
    (dict(top_k=2, capacity_factor=float("inf")), r"capacity_factor=inf: must be a finite number, or None"),
    (dict(top_k=2, aux_loss_coef=None), r"aux_loss_coef=None: must be a finite number$"),
    (dict(top_k=2, init_std=None), r"init_std=None: must be a finite number"),
    (dict(top_k=2, ep_size="2"), r"ep_size='2': must be an int, or None"),
    (dict(top_k=2, num_shared_experts=1, shared_intermediate_size=12.5),
     r"shared_intermediate_size=12.5: must be an int, or None"),
    (dict(top_k=True), r"top_k=True: must be an int"),
    # finite but absurd: each names its range (issue 46)
    (dict(top_k=2, capacity_factor=1e300), r"capacity_factor=1e\+300: must be <= 65536; allowed: 0 < capacity_factor "
                                           r"<= 65536, or None; pass None for dropless routing"),
    (dict(top_k=2, intermediate_size=2**30), r"intermediate_size=1073741824: must be <= 1048576; allowed: 1 <= "),
    (dict(top_k=2, bias_update_rate=2.0), r"bias_update_rate=2.0: must be <= 1; allowed: 0 <= bias_update_rate <= 1"),
    (dict(top_k=2, num_linears=3), r"num_linears=3: use 2 .* or 1 .*; allowed: 1 <= num_linears <= 2"),
    (dict(top_k=2, init_std=float("nan")), r"init_std=nan: must be a finite number; allowed: 0 < init_std <= 1"),
    (dict(top_k=2, expert_bias=1), r"expert_bias=1: must be True or False"),
])
def test_config_errors(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        _config(**kwargs)
