"""Pydantic v2 schemas of the OpenAI request bodies, split by concern.

Built by the server's parse functions (``chat.parse_chat_request``,
``completions.parse_completion_request``) once per HTTP request on rank 0's event-loop
thread; owned by the server package. ``validation`` turns a pydantic ``ValidationError`` into
the OpenAI-shaped ``ApiError``; ``messages``, ``tools`` and ``structured`` hold the models of
one field family each; ``request_fields`` the fields both bodies share; ``chat_body`` and
``completion_body`` assemble the two request bodies.
Nothing here imports torch or the engine.
"""
