// Package journal keeps a sandbox's steps: every exec runs under an id,
// in <sandbox>/execs/<id>/ with its output (stdout, stderr) and, once it
// ended, result.json; each result is also a line of the sandbox's
// results log, synced before it is told. An id runs at most once per
// sandbox: asking again
// returns the journaled result, or waits for it. Running the command is
// the caller's (package runtime, over a backend.Instance); the journal
// decides whether it runs and records how it ended.
//
// The output files never reach the sandbox: the command writes to pipes
// (or a terminal), and one process outside its reach copies them into
// the files (a Sink): the sandbox's init, which outlives the worker, so
// the output does too; the worker for a terminal; a microVM's shim. The
// writer bounds an exec's output (both streams together) by a cap,
// reading and dropping what passes it (the result counts it: Truncated),
// and stops writing when the command ends: what the pipes hold then is
// the step's last output, its files are closed, and only then is the
// exit told. Processes the command left may write on; nothing of theirs
// is journaled.
//
// A sandbox's journal stays within its disk bound: before a step starts,
// the outputs of the oldest ended steps are emptied until what the
// journal holds and the new step's cap fit (their results stay, marked
// OutputDropped).
package journal

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/durable"
	"github.com/dsec-project/dsec/internal/runtime/backend"
)

// Result is how an exec ended. Err, when set, is an infrastructure
// failure: the sandbox died under the command (a stop is no failure:
// the command's result is then 137, killed).
type Result struct {
	ID       string `json:"id"`
	ExitCode int    `json:"exit_code"`
	OOM      bool   `json:"oom,omitempty"`
	// Args is the command the id ran, so that a replay asking for
	// another is refused, not answered with this one's result.
	Args     []string  `json:"args,omitempty"`
	Err      string    `json:"error,omitempty"`
	Started  time.Time `json:"started"`
	Finished time.Time `json:"finished"`
	// Truncated counts the bytes of output (both streams) past the
	// exec's cap: read and dropped, never journaled.
	Truncated int64 `json:"truncated,omitempty"`
	// OutputDropped: the output was emptied later, to keep the
	// sandbox's journal within its disk bound.
	OutputDropped bool `json:"output_dropped,omitempty"`
}

// ErrInfra marks failures of the sandbox or the host, not of a command
// (api's).
var ErrInfra = api.ErrInfra

// Exec is a journaled command, running or ended.
type Exec struct {
	ID      string
	dir     string
	done    chan struct{}
	res     Result
	j       *Journal    // nil: loaded from its result
	limit   int64       // the cap on its output
	over    bool        // ended, as the journal counts (under Journal.usage)
	dropped atomic.Bool // its output was emptied (OutputDropped)
	// keep: the result is written before it is told. Not in a call's
	// sandbox: it runs one command, and goes before the worker does (a
	// worker that starts removes those of one that died), so the exec in
	// memory is all a replay finds, and its answer waits for no file.
	keep bool
	// journaled: ended, its result.json written; set before done closes.
	journaled bool
}

// StdoutPath and StderrPath are the journaled output files.
func (e *Exec) StdoutPath() string { return filepath.Join(e.dir, "stdout") }
func (e *Exec) StderrPath() string { return filepath.Join(e.dir, "stderr") }

// Limit is the cap on the exec's output, both streams together: what
// the writer of its files (a Sink) keeps at most.
func (e *Exec) Limit() int64 { return e.limit }

// Done is closed when the command has ended and its result is journaled.
func (e *Exec) Done() <-chan struct{} { return e.done }

// Result waits for the command to end.
func (e *Exec) Result(ctx context.Context) (Result, error) {
	select {
	case <-e.done:
	case <-ctx.Done():
		return Result{}, ctx.Err()
	}
	res := e.res
	res.OutputDropped = res.OutputDropped || e.dropped.Load()
	if res.Err != "" {
		return res, fmt.Errorf("exec %s: %s: %w", e.ID, res.Err, ErrInfra)
	}
	return res, nil
}

// Finish records how the command ended (r's exit code, OOM, Err and
// Truncated; the rest is the exec's), journals it and wakes the
// waiters. Its output files must be closed by then: the result and the
// output agree. A worker killed before the result's line is synced
// leaves none: the next asks the init (Recover).
func (e *Exec) Finish(r Result) {
	e.res.ExitCode, e.res.OOM, e.res.Err, e.res.Truncated = r.ExitCode, r.OOM, r.Err, r.Truncated
	e.res.Finished = time.Now().UTC()
	if e.j != nil {
		e.j.ended(e)
	}
	if e.keep {
		// The result is what a retry after a host crash finds instead
		// of running the step again: appended to the journal's log and
		// synced before it is told (one fdatasync of an append, where a
		// file of its own, renamed and its directory synced, took two
		// fsyncs), and written to result.json, without waiting for the
		// disk, for readers. Its output is not synced, so a crash may cut
		// what a replay prints.
		b, _ := json.Marshal(e.res)
		if err := e.j.logResult(e.res, b); err != nil {
			e.res.Err = "journal the result: " + err.Error()
		} else {
			e.journaled = durable.Replace(filepath.Join(e.dir, "result.json"), b, 0o600) == nil
		}
	}
	close(e.done)
}

var idRE = sync.OnceValue(func() *regexp.Regexp { return regexp.MustCompile(`^[a-zA-Z0-9][a-zA-Z0-9_.:@-]{0,127}$`) })

// Journal is the execs of one sandbox, under dir.
type Journal struct {
	dir   string
	mu    sync.Mutex // held while a step starts: an id runs once
	execs map[string]*Exec

	// The results log: its path, and once read the results it holds of
	// execs whose result.json a host crash lost (none, but after one).
	// w is held while a line is appended and synced, the log's mutex
	// only while its map is used, so that a start or a look-up never
	// waits for another exec's flush.
	logPath string
	w       sync.Mutex
	log     struct {
		sync.Mutex
		read    bool
		synced  bool // the log's name is on the disk (its directory synced)
		results map[string]Result
	}

	// What the outputs of ended execs take (once counted), those
	// outputs, oldest first, and the execs running.
	usage struct {
		sync.Mutex
		counted bool
		bytes   int64
		outputs []output
		running map[*Exec]bool
	}
}

// output is an ended exec's output, as the journal counts it.
type output struct {
	id    string
	bytes int64
}

// Open is the journal under dir (a sandbox's execs directory, which
// exists), its results appended to the file log. synced says the log's
// name is on the disk already (made with the sandbox, before a synced
// write to its directory); else the first result appended syncs the
// log's directory.
func Open(dir, log string, synced bool) *Journal {
	j := &Journal{dir: dir, execs: map[string]*Exec{}, logPath: log}
	j.log.synced = synced
	return j
}

// Step is a command to journal.
type Step struct {
	Sandbox string // its name, for errors
	ID      string
	Args    []string
	// Keep writes its result (every sandbox's but a call's: Exec).
	Keep bool
	// MaxOutput caps its output, both streams together (0:
	// DefaultMaxOutput); Bound, if set, bounds the journal's outputs
	// together (the sandbox's disk bound), the cap included.
	MaxOutput, Bound int64
}

// Start runs s once. If its id ran before (in this worker's life or an
// earlier one) Start returns that exec, replayed: start is not called.
// Otherwise it makes room for its output (Bound), makes the exec's
// directory and output files and calls start with the exec and the
// files, for the writer of its output (never the command) to write
// within e.Limit(); start returns once the command started (or ended),
// and the exec then ends by its Finish. An error of start is Start's,
// and leaves nothing journaled.
func (j *Journal) Start(s Step, start func(e *Exec, stdout, stderr *os.File) error) (e *Exec, replayed bool, err error) {
	if !idRE().MatchString(s.ID) {
		return nil, false, fmt.Errorf("bad exec id %q: use up to 128 letters, digits and '_.:@-': %w", s.ID, errdefs.ErrInvalidArgument)
	}
	if len(s.Args) == 0 {
		return nil, false, fmt.Errorf("exec: no command: %w", errdefs.ErrInvalidArgument)
	}
	j.mu.Lock()
	defer j.mu.Unlock()
	replay := func(e *Exec) (*Exec, bool, error) {
		if len(e.res.Args) > 0 && !slices.Equal(e.res.Args, s.Args) {
			return nil, false, fmt.Errorf("exec id %s ran %q in sandbox %s already, and this asks for %q: a retry must ask for the same command; give another --id for another: %w",
				s.ID, strings.Join(e.res.Args, " "), s.Sandbox, strings.Join(s.Args, " "), errdefs.ErrAlreadyExists)
		}
		return e, true, nil
	}
	if e := j.execs[s.ID]; e != nil {
		return replay(e)
	}
	dir := filepath.Join(j.dir, s.ID)
	if e, err := j.load(s.ID); err == nil {
		j.execs[e.ID] = e
		return replay(e)
	}
	if err := os.Mkdir(dir, 0o700); err != nil {
		return nil, false, err
	}
	var files [2]*os.File
	for i, name := range []string{"stdout", "stderr"} {
		jf, err := os.OpenFile(filepath.Join(dir, name), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
		if err != nil {
			os.RemoveAll(dir)
			return nil, false, err
		}
		// Sent with the request, the kernel holds them from then on.
		defer jf.Close()
		files[i] = jf
	}
	e = &Exec{ID: s.ID, dir: dir, done: make(chan struct{}), keep: s.Keep, j: j}
	e.res.ID, e.res.Started, e.res.Args = s.ID, time.Now().UTC(), s.Args
	e.limit = j.reserve(e, cmp.Or(s.MaxOutput, DefaultMaxOutput), s.Bound)
	if err := start(e, files[0], files[1]); err != nil {
		j.release(e)
		os.RemoveAll(dir)
		return nil, false, err
	}
	j.forget()
	j.execs[e.ID] = e
	return e, false, nil
}

// held is how many execs a journal holds in memory before it lets go of
// those whose results a replay reads back from their files.
const held = 64

// forget lets go of ended execs a replay or a look-up reads back from
// their result.json (loaded ones, and those this journal wrote), so that
// a sandbox of thousands of steps is not held in memory whole. j.mu is
// held.
func (j *Journal) forget() {
	if len(j.execs) < held {
		return
	}
	for id, e := range j.execs {
		select {
		case <-e.done:
			if e.j == nil || e.journaled {
				delete(j.execs, id)
			}
		default:
		}
	}
}

// load is exec id as journaled, ended.
func (j *Journal) load(id string) (*Exec, error) {
	res, err := j.result(id)
	if err != nil {
		return nil, err
	}
	e := &Exec{ID: id, dir: filepath.Join(j.dir, id), done: make(chan struct{}), over: true, res: res}
	close(e.done)
	return e, nil
}

// result is exec id's journaled result: its result.json, else the log's
// (a host crash lost the file, written without waiting for the disk;
// it is put back, and the exec's directory with it).
func (j *Journal) result(id string) (Result, error) {
	var res Result
	p := filepath.Join(j.dir, id, "result.json")
	b, err := os.ReadFile(p)
	if err == nil && json.Unmarshal(b, &res) == nil && res.ID == id {
		return res, nil
	}
	res, ok := j.logged(id)
	if !ok {
		return Result{}, fmt.Errorf("no result of exec %s: %w", id, os.ErrNotExist)
	}
	if b, err := json.Marshal(res); err == nil && os.MkdirAll(filepath.Dir(p), 0o700) == nil {
		for _, name := range []string{"stdout", "stderr"} { // what the crash left of them, or empty
			if f, err := os.OpenFile(filepath.Join(filepath.Dir(p), name), os.O_CREATE|os.O_WRONLY, 0o600); err == nil {
				f.Close()
			}
		}
		durable.Replace(p, b, 0o600)
	}
	return res, nil
}

// logged is exec id's result as the log has it, if its result.json is
// lost. The log is read once, keeping the results of those alone: an
// exec whose file exists is read from it, so the worker holds no copy
// of a long sandbox's log, and results appended later have their files.
func (j *Journal) logged(id string) (Result, bool) {
	j.log.Lock()
	defer j.log.Unlock()
	if !j.log.read {
		j.log.read, j.log.results = true, map[string]Result{}
		b, _ := os.ReadFile(j.logPath)
		last := map[string]Result{}
		for line := range bytes.SplitSeq(b, []byte("\n")) {
			var res Result
			if json.Unmarshal(line, &res) == nil && res.ID != "" && idRE().MatchString(res.ID) { // a line a crash cut is no result
				last[res.ID] = res // a later line (a drop's mark) wins
			}
		}
		for id, res := range last {
			if _, err := os.Stat(filepath.Join(j.dir, id, "result.json")); errors.Is(err, os.ErrNotExist) {
				j.log.results[id] = res
			}
		}
	}
	res, ok := j.log.results[id]
	return res, ok
}

// logResult appends res (b, its JSON) to the log and syncs it; the
// first time, the log's directory too unless the log was made synced.
// A line that fails is cut off again, so that it never replays.
func (j *Journal) logResult(res Result, b []byte) error {
	j.w.Lock()
	defer j.w.Unlock()
	f, err := os.OpenFile(j.logPath, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600)
	if err != nil {
		return err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return err
	}
	// Each line begins with its newline: a line a crash cut short at the
	// end is ended by the next, not joined to it.
	_, err = f.Write(append([]byte{'\n'}, b...))
	if err == nil {
		err = datasync(f)
	}
	if err != nil {
		f.Truncate(st.Size())
		return err
	}
	j.log.Lock()
	synced := j.log.synced
	j.log.Unlock()
	if !synced {
		if err := durable.SyncDir(filepath.Dir(j.logPath)); err != nil {
			f.Truncate(st.Size())
			return err
		}
	}
	j.log.Lock()
	j.log.synced = true
	if j.log.read {
		delete(j.log.results, res.ID) // its result.json is next
	}
	j.log.Unlock()
	return nil
}

// logMark appends res, an ended exec's result marked since (its output
// dropped), to the log without syncing it, as its result.json is
// rewritten: a crash that loses both finds the output short, as a
// crash may anyway (output is not synced).
func (j *Journal) logMark(res Result) {
	b, err := json.Marshal(res)
	if err != nil {
		return
	}
	j.w.Lock()
	defer j.w.Unlock()
	f, err := os.OpenFile(j.logPath, os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return
	}
	defer f.Close()
	f.Write(append([]byte{'\n'}, b...))
}

// Lookup returns the exec with id, running or journaled, of the
// sandbox named sandbox.
func (j *Journal) Lookup(sandbox, id string) (*Exec, error) {
	if !idRE().MatchString(id) {
		return nil, fmt.Errorf("bad exec id %q: %w", id, errdefs.ErrInvalidArgument)
	}
	j.mu.Lock()
	defer j.mu.Unlock()
	if e := j.execs[id]; e != nil {
		return e, nil
	}
	e, err := j.load(id)
	if err != nil {
		return nil, fmt.Errorf("sandbox %s has no exec %s: %w", sandbox, id, errdefs.ErrNotFound)
	}
	return e, nil
}

// Last is the id of the exec journaled last ("": none) and how many
// are journaled.
func (j *Journal) Last() (id string, n int) {
	ents := j.entries()
	var at time.Time
	for _, e := range ents {
		if fi, err := e.Info(); err == nil && (id == "" || fi.ModTime().After(at)) {
			id, at = e.Name(), fi.ModTime()
		}
	}
	return id, len(ents)
}

// Count counts the journaled execs.
func (j *Journal) Count() int { return len(j.entries()) }

// entries are the execs' directories.
func (j *Journal) entries() []os.DirEntry {
	ents, _ := os.ReadDir(j.dir)
	return ents
}

// Recover collects the results of the execs an earlier worker left
// running in c (nil: the sandbox's instance is gone): c still has them.
// One c never started (that worker died between journaling and asking)
// is forgotten, so that a retry runs it.
func (j *Journal) Recover(c backend.Instance) {
	j.mu.Lock()
	defer j.mu.Unlock()
	for _, ent := range j.entries() {
		dir := filepath.Join(j.dir, ent.Name())
		if _, err := os.Stat(filepath.Join(dir, "result.json")); err == nil {
			continue // ended (if its file does not parse, still not to be run again)
		}
		if _, err := j.result(ent.Name()); err == nil {
			continue
		}
		e := &Exec{ID: ent.Name(), dir: dir, done: make(chan struct{}), keep: true, j: j}
		e.res.ID = e.ID
		if st, err := os.Stat(filepath.Join(dir, "stdout")); err == nil {
			e.res.Started = st.ModTime().UTC()
		}
		if c == nil {
			e.Finish(Result{Err: "the sandbox died under the command (found on worker restart)"})
			continue
		}
		running, x, err := c.Probe(context.Background(), e.ID)
		if errors.Is(err, backend.ErrUnknownExec) {
			os.RemoveAll(dir)
			continue
		}
		j.execs[e.ID] = e
		j.usage.Lock()
		j.run(e)
		j.usage.Unlock()
		if !running { // it ended while no worker was there
			r := Result{ExitCode: x.Code, Truncated: x.Truncated}
			if err != nil {
				r.Err = "the sandbox died under the command"
			}
			e.Finish(r)
			continue
		}
		go func() { // still running: wait on it
			x, err := c.Result(context.Background(), e.ID)
			r := Result{ExitCode: x.Code, Truncated: x.Truncated}
			if err != nil {
				r.Err = "the sandbox died under the command"
			}
			e.Finish(r)
		}()
	}
}
