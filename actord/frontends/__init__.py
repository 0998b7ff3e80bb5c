"""How clients reach a system: the JSON-RPC socket (`rpc/`), the HTTP fronts (`http/`:
OpenAI's API and llama-server's), the daemon, the socket client and the CLI. Fronts speak to
the service; they never run engine jobs themselves."""
