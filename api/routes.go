package api

// Route is a route of the worker's API: what docs/reference/api.md
// says of it (gen-docs writes it from Routes). The worker's own table,
// the patterns it registers, is another; a test of the worker's keeps
// the two the same.
type Route struct {
	// Method is GET, POST, PUT or DELETE; "": any method (a relay).
	Method string
	// Path is the pattern as net/http's ServeMux takes it: {name} is one
	// segment of the path, {ref...} the rest of it.
	Path string
	// Query is the query parameters it reads, if any.
	Query string
	// Admin: over TCP, only an admin token may call it (a token of scope
	// sandboxes is refused, 403). The unix socket is the admin's.
	Admin bool
	// Request and Response are the types of the JSON body and answer
	// (a type of this package; []T: a list of T); "": none.
	Request, Response string
	// RequestBody and ResponseBody say how a body or an answer that is
	// not one JSON value (or nothing) is sent: streamed, as JSON lines or
	// bytes, or relayed.
	RequestBody, ResponseBody string
	// Status is the answer's status when the call succeeds: 200, 201 for
	// what it made, 204 for no body; 0: the relayed answer's.
	Status int
	// Summary says what it does, in a line.
	Summary string
}

// How a body or an answer is sent, when it is not one JSON value.
const (
	// BodyLines: JSON lines of the type, each as it comes.
	BodyLines = "lines"
	// BodyBytes: bytes (a file's, a tar stream's); after a JSON line of
	// the type, if the route names one (a command's stdin).
	BodyBytes = "bytes"
	// BodyRelayed: what the caller sends, relayed, and what the target
	// answers.
	BodyRelayed = "relayed"
	// BodyWebSocket: the request upgrades to a WebSocket (status 101),
	// whose messages carry the route's protocol both ways.
	BodyWebSocket = "websocket"
)

// Routes are the routes of the worker's API, served on the root's
// socket and on its TCP addresses alike; an error is an Error body and
// the status of its class (ErrorOf).
var Routes = []Route{
	{Method: "GET", Path: "/v1/version", Response: "VersionInfo", Status: 200,
		Summary: "The worker's version, its limits, the host features it lacks, its capacity"},
	{Method: "POST", Path: "/v1/shutdown", Admin: true, Status: 204,
		Summary: "Stop the worker; its sandboxes keep running"},

	{Method: "POST", Path: "/v1/sandboxes", Request: "SandboxSpec", Response: "Sandbox", Status: 201,
		Summary: "Create a sandbox and start it (queued while admission holds it)"},
	{Method: "GET", Path: "/v1/sandboxes", Query: "all=1 (warm pool sandboxes too), brief=1 (without what each uses now)",
		Response: "[]Sandbox", Status: 200, Summary: "List the sandboxes, queued and being made ones too"},
	{Method: "GET", Path: "/v1/sandboxes/{name}", Response: "Sandbox", Status: 200, Summary: "Describe a sandbox"},
	{Method: "POST", Path: "/v1/sandboxes/{name}/stop", Response: "Sandbox", Status: 200,
		Summary: "Stop a sandbox's processes; its files are kept"},
	{Method: "POST", Path: "/v1/sandboxes/{name}/start", Response: "Sandbox", Status: 200,
		Summary: "Start a stopped sandbox again"},
	{Method: "POST", Path: "/v1/sandboxes/{name}/pause", Response: "Sandbox", Status: 200,
		Summary: "Freeze a sandbox's processes, their memory kept"},
	{Method: "POST", Path: "/v1/sandboxes/{name}/resume", Response: "Sandbox", Status: 200,
		Summary: "Let a paused sandbox run on (an evicted one's guest restored)"},
	{Method: "POST", Path: "/v1/sandboxes/{name}/idle", Request: "IdleRequest", Response: "IdleReport", Status: 200,
		Summary: "Hint that the sandbox waits for the model: frozen, its memory given back, until its next exec"},
	{Method: "POST", Path: "/v1/sandboxes/{name}/evict", Response: "Sandbox", Status: 200,
		Summary: "Pause a microVM and save its guest to disk, its memory given back to the host"},
	{Method: "DELETE", Path: "/v1/sandboxes/{name}", Query: "force=1 (a running one too)", Status: 204,
		Summary: "Remove a sandbox"},

	{Method: "POST", Path: "/v1/sandboxes/{name}/exec", Request: "ExecRequest", Response: "Frame", Status: 200, RequestBody: BodyBytes, ResponseBody: BodyLines,
		Summary: "Run a command: an ExecRequest line, then its stdin; answered with Frame lines, its output as journaled, then its result"},
	{Method: "GET", Path: "/v1/sandboxes/{name}/execs/{id}", Query: "follow=1 (follow a running one to its result)",
		Response: "Frame", Status: 200, ResponseBody: BodyLines, Summary: "Replay a journaled command's output and result, as Frame lines"},
	{Method: "POST", Path: "/v1/sandboxes/{name}/execs/{id}/signal", Request: "SignalRequest", Status: 204,
		Summary: "Signal a running command's process group"},

	{Method: "PUT", Path: "/v1/sandboxes/{name}/files", Query: "path=P, mode=M (octal permission bits, default 0644)", Status: 204, RequestBody: BodyBytes,
		Summary: "Write a file, atomically: the body is its bytes"},
	{Method: "GET", Path: "/v1/sandboxes/{name}/files", Query: "path=P", Status: 200, ResponseBody: BodyBytes,
		Summary: "Read a file: the answer is its bytes"},
	{Method: "GET", Path: "/v1/sandboxes/{name}/screen", Status: 200, ResponseBody: BodyBytes,
		Summary: "The screen of a full VM as PNG: the answer is its bytes, its size and count in the X-Dsec-Screen-* headers"},
	{Method: "POST", Path: "/v1/sandboxes/{name}/input", Request: "Input", Status: 204,
		Summary: "Type text, press a key, or move, click, drag or scroll the mouse of a full VM"},
	{Method: "POST", Path: "/v1/sandboxes/{name}/vnc", Response: "VNC", Status: 200,
		Summary: "Grant a token to a full VM's screen over VNC, ending the grant before"},
	{Method: "DELETE", Path: "/v1/sandboxes/{name}/vnc", Status: 204,
		Summary: "End the sandbox's VNC grant and the connections it opened"},
	{Method: "GET", Path: "/v1/vnc/{name}", Query: "token=T (the grant's, or Authorization: Bearer T; no API token)", Status: 101,
		RequestBody: BodyWebSocket, ResponseBody: BodyWebSocket,
		Summary: "A WebSocket (subprotocol binary) carrying RFB to and from a full VM's VNC server, opened by a grant's token alone"},
	{Method: "GET", Path: "/v1/sandboxes/{name}/stat", Query: "path=P, follow=1 (a symlink's target)", Response: "PathStat", Status: 200,
		Summary: "Describe a path"},
	{Method: "GET", Path: "/v1/sandboxes/{name}/dir", Query: "path=P, depth=N (default 1)", Response: "[]DirEntry", Status: 200,
		Summary: "List a directory, depth levels down"},
	{Method: "POST", Path: "/v1/sandboxes/{name}/mkdir", Query: "path=P, parents=1", Response: "PathStat", Status: 200,
		Summary: "Make a directory (and its missing parents, with parents=1)"},
	{Method: "POST", Path: "/v1/sandboxes/{name}/rename", Query: "path=P, to=Q", Response: "PathStat", Status: 200,
		Summary: "Move a path, replacing a file there; answered with Q's stat"},
	{Method: "DELETE", Path: "/v1/sandboxes/{name}/files", Query: "path=P, recursive=1 (a whole tree)", Status: 204,
		Summary: "Remove a file, a link or a tree"},
	{Method: "GET", Path: "/v1/sandboxes/{name}/archive", Query: "path=P, follow=1, name=N (the tree's name in the stream)",
		Status: 200, ResponseBody: BodyBytes,
		Summary: "Copy a tree out: the X-Dsec-Stat header (a PathStat), then a tar stream; an error once it started is its X-Dsec-Error trailer (an Error), what it left out its X-Dsec-Skipped trailer (a CopyReport)"},
	{Method: "PUT", Path: "/v1/sandboxes/{name}/archive", Query: "path=DIR, owners=1 (keep the stream's owners)", Response: "CopyReport",
		Status: 200, RequestBody: BodyBytes, Summary: "Copy a tree in: the body is a tar stream, extracted into DIR"},
	{Path: "/v1/sandboxes/{name}/ports/{port}/{path...}", RequestBody: BodyRelayed, ResponseBody: BodyRelayed,
		Summary: "Relay an HTTP request (a WebSocket's too) to a port of the sandbox's address (network mode nat), without the caller's credentials"},

	{Method: "POST", Path: "/v1/sandboxes/{name}/snapshots", Request: "PackRequest", Response: "Snapshot", Status: 201,
		Summary: "Pack a running sandbox's changes into a snapshot layer (pack-diff)"},
	{Method: "POST", Path: "/v1/branches", Request: "BranchRequest", Response: "[]Sandbox", Status: 201,
		Summary: "Start N sandboxes on one snapshot: every one or none"},
	{Method: "POST", Path: "/v1/sandboxes/{name}/grade", Request: "GradeRequest", Response: "Grade", Status: 200,
		Summary: "Grade a sandbox in a fresh one: only what the carry rules take of its changes, with a tamper report"},
	{Method: "POST", Path: "/v1/sandboxes/{name}/fork", Request: "ForkRequest", Response: "Group", Status: 201,
		Summary: "Fork a sandbox into a group: one pack-diff and N sandboxes on it, held by a lease"},
	{Method: "GET", Path: "/v1/groups", Response: "[]Group", Status: 200, Summary: "The caller's fork groups, each member's state and last exec"},
	{Method: "GET", Path: "/v1/groups/{id}", Response: "Group", Status: 200, Summary: "A fork group, each member's state and last exec"},
	{Method: "DELETE", Path: "/v1/groups/{id}", Response: "Released", Status: 200,
		Summary: "Remove a group's members, and its snapshot unless something else stands on it"},
	{Method: "POST", Path: "/v1/groups/{id}/keep", Request: "KeepRequest", Response: "Released", Status: 200,
		Summary: "Keep one member of a group (the next step's parent) and remove the others"},
	{Method: "POST", Path: "/v1/leases", Request: "LeaseRequest", Response: "Lease", Status: 201, Summary: "Make a lease of TTL seconds"},
	{Method: "GET", Path: "/v1/leases", Response: "[]Lease", Status: 200, Summary: "The caller's leases and what each holds"},
	{Method: "GET", Path: "/v1/leases/{id}", Response: "Lease", Status: 200, Summary: "A lease and what it holds"},
	{Method: "POST", Path: "/v1/leases/{id}/renew", Request: "LeaseRequest", Response: "Lease", Status: 200,
		Summary: "Renew a lease: it expires TTL seconds from now"},
	{Method: "DELETE", Path: "/v1/leases/{id}", Response: "Released", Status: 200,
		Summary: "End a lease: what it holds is removed, snapshots untagged unless something else stands on them"},
	{Method: "GET", Path: "/v1/snapshots", Query: "name=REF (that snapshot alone)", Response: "[]SnapshotNode", Status: 200,
		Summary: "The snapshots' lineage DAG"},
	{Method: "DELETE", Path: "/v1/snapshots/{ref...}", Query: "force=1 (one something stands on too)", Status: 204,
		Summary: "Untag a snapshot nothing stands on"},
	{Method: "POST", Path: "/v1/squash", Admin: true, Request: "SquashRequest", Response: "Snapshot", Status: 201,
		Summary: "Fold a chain of snapshots into one new snapshot"},

	{Method: "POST", Path: "/v1/estimates", Admin: true, Request: "EstimateRequest", Response: "Estimate", Status: 200,
		Summary: "What a create on these layers would fetch here (a gateway's placement)"},
	{Method: "POST", Path: "/v1/claims", Admin: true, Request: "ClaimRequest", Status: 204,
		Summary: "Claim or release sandbox names for a gateway's fleet"},
	{Method: "PUT", Path: "/v1/cordon", Admin: true, Request: "CordonRequest", Response: "CordonRequest", Status: 200,
		Summary: "Cordon or uncordon the worker: gateways place no create on a cordoned one"},
	{Path: "/v1/e2b/", Admin: true, RequestBody: BodyRelayed, ResponseBody: BodyRelayed,
		Summary: "Relay a gateway's E2B front's request to this worker's: /v1/e2b/control/PATH, /v1/e2b/sandbox/NAME/PORT/PATH or /v1/e2b/token/NAME/PORT/PATH"},

	{Method: "POST", Path: "/v1/sandboxes/{name}/policy", Request: "PolicyRequest", Response: "PolicyReport", Status: 200,
		Summary: "Apply a policy to a running sandbox"},
	{Method: "GET", Path: "/v1/policies", Response: "[]Policy", Status: 200, Summary: "List the stored policies"},
	{Method: "GET", Path: "/v1/policies/{name}", Response: "Policy", Status: 200, Summary: "Show a stored policy"},
	{Method: "PUT", Path: "/v1/policies/{name}", Admin: true, Request: "Policy", Status: 204, Summary: "Store a policy under a name"},
	{Method: "DELETE", Path: "/v1/policies/{name}", Admin: true, Status: 204, Summary: "Remove a stored policy"},

	{Method: "POST", Path: "/v1/calls", Request: "CallRequest", Response: "Frame", Status: 200, RequestBody: BodyBytes, ResponseBody: BodyLines,
		Summary: "Run one command in a fresh sandbox (FnCall) and discard it: a CallRequest line, then its stdin; answered with Frame lines"},
	{Method: "POST", Path: "/v1/batches", Request: "BatchRequest", Response: "BatchItem", Status: 200, ResponseBody: BodyLines,
		Summary: "Make many sandboxes of one spec at once: a BatchItem line as each is made or fails"},
	{Method: "GET", Path: "/v1/pools", Response: "[]Pool", Status: 200, Summary: "List the FnCall pools"},
	{Method: "PUT", Path: "/v1/pools/{name}", Admin: true, Request: "PoolSpec", Response: "Pool", Status: 200,
		Summary: "Make a FnCall pool, or resize one"},
	{Method: "DELETE", Path: "/v1/pools/{name}", Admin: true, Status: 204, Summary: "Remove a pool and discard its warm sandboxes"},
}
