"""Vision-language-action policies: what SmolVLA, π0 and π0.5 share (LeRobot 0.6.1's flow-matching VLAs).

A VLA kind writes its model and nothing else; this package holds the rest, free of any one
model's specifics:

- ``policy.VLAPolicy``: the StatefulPolicy base (a ``LeRobotPolicy``). A kind subclasses it and
  implements ``encode_prefix(state) -> prefix`` (images, task tokens, state through the VLM:
  the prefix K/V, scratch of one plan) and ``velocity(prefix, x_t, time) -> v_t`` (one pass of
  the action expert). The base gives the chunk cadence, the plan (noise, prefix, Euler loop,
  RTC guidance, the chunk cut to the action's dimensions), ``emit`` (unnormalised action and
  chunk), the task input (a text port or the ``vla.task`` state buffer, ``task_tokens``,
  ``text_inputs``) and ``bind_schedule``.
- ``flow``: ``EulerFlow`` (LeRobot's ``euler_integrate`` with constant time buffers) and
  ``flow_noise`` (the initial sample from the arena's counter-based RNG).
- ``rtc``: ``RTCSettings`` (``control.rtc`` and LeRobot's names) and ``RTCGuidance`` (the
  leftover, the prefix weights, the guided velocity, exact and without autograd).
- ``tokens``: ``TokenizerOptions`` (the checkpoint's tokenizer step), ``load_tokenizer``
  (offline ``AutoTokenizer``), ``TaskTokenizer`` (a task string -> int64 [2, max_length] ids
  and mask, as LeRobot's processor makes them).
- ``side_by_side``: ``SideBySide`` (independent calls, such as the cameras' vision towers, on
  CUDA streams of their own: parallel branches of a captured refill, the same bits).
- ``kind``: ``VLASettings`` (the section a VLA kind extends: ``vlm_files``),
  ``task_and_features`` (the ``task:<port>`` entry of the feature map), ``local_files`` (the
  local directory standing in for the hub), ``files_digest``.

transformers is imported only by the functions that need it, so that other policy kinds
never pay for it.
"""
