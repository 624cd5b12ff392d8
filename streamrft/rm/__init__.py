"""Reward-model training and use: scalar reward models (SRM) and generative judges (GRM).

``streamrft train-rm CONFIG`` trains either kind (``kind: srm | grm`` in the RM config, see
:mod:`streamrft.rm.config`); ``streamrft eval-rm`` reports held-out pairwise accuracy. A trained
directory is a reward source in RL (``reward.sources: [{type: model, model_path: DIR}]``) and can be
served with ``streamrft serve-reward --fn model:DIR``.
"""
