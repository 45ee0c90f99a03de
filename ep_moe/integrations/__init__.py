"""Adapters that put :class:`ep_moe.MoELayer` behind other frameworks' MoE interfaces.

:mod:`ep_moe.integrations.deepspeed` is a drop-in for ``deepspeed.moe.layer.MoE``; it
imports without DeepSpeed installed.
"""
