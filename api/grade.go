package api

import "encoding/json"

// GradingPolicy is a policy's grading section: what of an agent's
// changes a grade carries into the grader's sandbox.
type GradingPolicy struct {
	// Carry are the paths that are the agent's answer: absolute glob
	// patterns ("*" within a segment, "**" whole segments), "!" in
	// front of one that is never carried (the tests): /work/repo/**,
	// !/work/repo/tests/**.
	Carry []string `json:"carry,omitempty"`
	// Never are paths no grade carries even where Carry takes them;
	// default: interpreters' startup hooks and bytecode (conftest.py,
	// pytest.ini, sitecustomize.py, usercustomize.py, *.pth,
	// __pycache__, *.pyc). An empty list carries them.
	Never []string `json:"never,omitempty"`
	// MaxFileBytes: a carried file larger is left out and reported
	// (bytes or 64M, 1G; default 64M).
	MaxFileBytes string `json:"maxFileBytes,omitempty"`
}

// GradeRequest grades a sandbox in a fresh one: what the carry rules
// take of the agent's changes, over the sandbox's own layers, under the
// grader's layers, with no network and none of the agent's processes.
type GradeRequest struct {
	// ID makes the grade exactly-once: the same id answers what it
	// answered (default: generated).
	ID string `json:"id,omitempty"`
	// Grader are the grader's layers (topmost first), stacked over the
	// carried changes: what the agent left cannot shadow them.
	Grader []string `json:"grader"`
	// Carry, when given, are the carry rules instead of the policy's.
	Carry []string `json:"carry,omitempty"`
	// Args is the grader's command; Env, Cwd and User as an exec's.
	Args []string `json:"args"`
	Env  []string `json:"env,omitempty"`
	Cwd  string   `json:"cwd,omitempty"`
	User string   `json:"user,omitempty"`
	// Timeout bounds the grader's command, in seconds (default 600).
	Timeout int `json:"timeout,omitempty"`
	// Result is where the grader may write its JSON result (default
	// /tmp/dsec-grade.json; also in its env as DSEC_GRADE_RESULT).
	Result string `json:"result,omitempty"`
}

// DefaultGradeResult is where a grader writes its JSON result unless
// the request says.
const DefaultGradeResult = "/tmp/dsec-grade.json"

// GradeVersion versions a grade's answer and its tamper report.
const GradeVersion = "dsec.grade/v1"

// Grade is a grade's answer.
type Grade struct {
	Version  string `json:"version"`
	ID       string `json:"id"`
	Sandbox  string `json:"sandbox"`
	ExitCode int    `json:"exit_code"`
	// Stdout and Stderr are the grader's output (each up to 1 MiB).
	Stdout string `json:"stdout"`
	Stderr string `json:"stderr"`
	// Result is the JSON the grader wrote to its result file, if any;
	// ResultError says why a file there was not taken.
	Result      json.RawMessage `json:"result,omitempty"`
	ResultError string          `json:"result_error,omitempty"`
	// TimedOut: the grader ran past its timeout and was killed.
	TimedOut bool         `json:"timed_out,omitempty"`
	Carried  CarriedFiles `json:"carried"`
	Tamper   TamperReport `json:"tamper"`
	// Seconds the grade took: freezing and reading the agent's changes
	// (the agent's sandbox frozen that long), starting the grader's
	// sandbox, and the grader's command.
	FrozenSeconds float64  `json:"frozen_seconds"`
	StartSeconds  float64  `json:"start_seconds"`
	GraderSeconds float64  `json:"grader_seconds"`
	CarryRules    []string `json:"carry_rules"`
}

// CarriedFiles is what a grade carried: the layer of it (the same
// changes give the same digest), and its paths and bytes.
type CarriedFiles struct {
	Digest string `json:"digest"`
	Paths  int    `json:"paths"`
	Bytes  int64  `json:"bytes"`
}

// TamperReport is what the agent changed that the grade did not carry,
// grouped, and what still ran in its sandbox.
type TamperReport struct {
	// Processes still running in the agent's sandbox when it was
	// graded, its init left out; -1: not counted (a guest's own).
	Processes int `json:"processes"`
	// Groups counts the paths of each group (api.Tamper*).
	Groups map[string]int `json:"groups"`
	// Paths, sorted; at most 1000, Truncated the rest.
	Paths     []TamperPath `json:"paths"`
	Truncated int          `json:"truncated,omitempty"`
}

// TamperPath is one path the agent changed that the grade left out.
type TamperPath struct {
	Path   string `json:"path"`
	Group  string `json:"group"`
	Change string `json:"change"` // added, modified, removed
	Type   string `json:"type"`   // file, dir, symlink, hardlink, device, fifo, socket
	Size   int64  `json:"size,omitempty"`
	// Digest of a regular file's bytes (sha256), up to 64 MiB.
	Digest string `json:"digest,omitempty"`
	Target string `json:"target,omitempty"` // a symlink's
	Why    string `json:"why,omitempty"`    // why a path the carry rules take was left out
}

// The groups of a tamper report.
const (
	TamperTests   = "tests"   // what the task's tests are
	TamperHooks   = "hooks"   // interpreters' startup hooks, bytecode
	TamperResult  = "result"  // the grader's result file, written by the agent
	TamperOnPath  = "path"    // commands on PATH
	TamperToolkit = "toolkit" // what the grader's layers hold
	TamperGuarded = "guarded" // the policy's hidden and read-only paths
	TamperPseudo  = "pseudo"  // /proc, /sys, /dev
	TamperLinks   = "links"   // links out of the carried paths
	TamperSpecial = "special" // device nodes, fifos, sockets
	TamperHuge    = "huge"    // carried files over the size bound
	TamperOther   = "other"
)
