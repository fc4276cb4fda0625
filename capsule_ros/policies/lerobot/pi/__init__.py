"""LeRobot's π0 and π0.5 (``policy.kind`` ``lerobot_pi0`` / ``lerobot_pi05``).

``architecture`` reads a checkpoint's dimensions without building anything, ``model``
builds the network from transformers' classes and LeRobot's hand-written glue (``gemma``),
``prompt`` tokenises the task (and π0.5's discretised state) on the host as LeRobot's
preprocessor does. LeRobot itself is never imported.
"""
