package e2b

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/durable"
)

// record is what E2B knows of a sandbox and dsec does not; one file,
// DIR/SANDBOX.json (the dsec sandbox's ID, which is never another's),
// written whole (durable.WriteFile) at every change. A record dies with
// its sandbox (Forget, when the worker removes it; reconcile, for what
// was removed while no front ran), so none ever speaks for a later
// sandbox of the same name. While a create is under way its sandbox has
// no ID yet: its record is DIR/pending-ID.json, synced, until it does;
// the record under the ID is then written without waiting for the disk
// (a create pays for one sync, not two), and the pending file stays
// until the record is next synced or dies: what a crash leaves is one
// or the other, and reconcile completes a pending one.
type record struct {
	ID string `json:"id"` // the E2B sandbox id: the dsec sandbox's name
	// Sandbox is the dsec sandbox's ID ("": not known yet).
	Sandbox string `json:"sandbox,omitempty"`
	// Owner is the id of the token that owns the sandbox (none: the
	// admin's, made over the worker's socket).
	Owner    string            `json:"owner,omitempty"`
	Template string            `json:"template"`
	Metadata map[string]string `json:"metadata,omitempty"`
	EnvVars  map[string]string `json:"env_vars,omitempty"`
	Started  time.Time         `json:"started"`
	// EndAt is when the sandbox's timeout passes; OnTimeout what
	// happens then: "kill" (default) or "pause" (PauseMemory: with its
	// memory, else its files only). Expired: it was paused for it.
	EndAt       time.Time `json:"end_at"`
	OnTimeout   string    `json:"on_timeout,omitempty"`
	PauseMemory bool      `json:"pause_memory,omitempty"`
	AutoResume  bool      `json:"auto_resume,omitempty"`
	Expired     bool      `json:"expired,omitempty"`
	// Procs are the commands started through envd, by pid: each a dsec
	// exec. NextPID is the pid the next one gets.
	Procs   []proc `json:"procs,omitempty"`
	NextPID uint32 `json:"next_pid,omitempty"`
	// Snapshots counts createSnapshot's steps; Forks the forks made.
	Snapshots int `json:"snapshots,omitempty"`
	Forks     int `json:"forks,omitempty"`

	// pending: DIR/pending-ID.json is there too, the synced record of
	// the create, behind this one that was not synced.
	pending bool
}

// proc is a command envd started: its pid (the front's number for it),
// its dsec exec id and what it was asked to run.
type proc struct {
	PID  uint32            `json:"pid"`
	Exec string            `json:"exec"`
	Tag  string            `json:"tag,omitempty"`
	Cmd  string            `json:"cmd"`
	Args []string          `json:"args,omitempty"`
	Envs map[string]string `json:"envs,omitempty"`
	Cwd  string            `json:"cwd,omitempty"`
}

// maxProcs bounds a record's processes: the oldest are forgotten (their
// execs stay in the sandbox's journal).
const maxProcs = 1024

// records are the front's records, cached in memory by E2B id (a live
// sandbox's name, which no other live sandbox has).
type records struct {
	dir string
	mu  sync.Mutex
	m   map[string]*record
}

// file is where rec is kept.
func (r *records) file(rec *record) string {
	if rec.Sandbox == "" {
		return r.pendingFile(rec.ID)
	}
	return filepath.Join(r.dir, rec.Sandbox+".json")
}

func (r *records) pendingFile(id string) string { return filepath.Join(r.dir, "pending-"+id+".json") }

// removeFiles removes rec's files.
func (r *records) removeFiles(rec *record) {
	os.Remove(r.file(rec))
	if rec.pending {
		os.Remove(r.pendingFile(rec.ID))
	}
}

func openRecords(dir string) (*records, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	r := &records{dir: dir, m: map[string]*record{}}
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	for _, e := range ents {
		name, ok := strings.CutSuffix(e.Name(), ".json")
		if !ok {
			continue
		}
		b, err := os.ReadFile(filepath.Join(dir, e.Name()))
		if err != nil {
			return nil, err
		}
		if len(b) == 0 && !strings.HasPrefix(name, "pending-") {
			// A write not synced that a crash cut: its pending file, if
			// any, is the record; else the sandbox has none.
			os.Remove(filepath.Join(dir, e.Name()))
			continue
		}
		var rec record
		err = json.Unmarshal(b, &rec)
		// Its file names its sandbox, or its id while pending (an older
		// front's: its id, with no sandbox recorded).
		if err == nil && name != rec.Sandbox && name != "pending-"+rec.ID && !(rec.Sandbox == "" && name == rec.ID) {
			err = fmt.Errorf("it is not the record of %s", name)
		}
		if err != nil || api.ValidName(rec.ID) != nil {
			return nil, fmt.Errorf("e2b record %s is damaged (%v): remove it to forget that sandbox's E2B state: %w", filepath.Join(dir, e.Name()), err, errdefs.ErrDataLoss)
		}
		if old := r.m[rec.ID]; old != nil {
			switch {
			case old.Started.Equal(rec.Started) && (old.Sandbox == "") != (rec.Sandbox == ""):
				// A create's pending record and the one written
				// after it: the latter, with the former behind it.
				if rec.Sandbox == "" {
					old.pending = true
					continue
				}
				rec.pending = true
			case old.Started.After(rec.Started): // two records of one name: the newer sandbox's is what lives
				continue
			}
		}
		r.m[rec.ID] = &rec
		if name != rec.Sandbox && name != "pending-"+rec.ID { // an older front's file: kept where it belongs
			if err := r.writeSync(&rec, true); err != nil {
				return nil, err
			}
			os.Remove(filepath.Join(dir, e.Name()))
		}
	}
	return r, nil
}

// reconcile drops the records whose sandbox is gone, or whose name now
// names another sandbox, and completes those a create left pending;
// lookup says which sandbox, if any, a name names now.
func (r *records) reconcile(lookup func(name string) (id string, ok bool)) {
	for _, rec := range r.all() {
		id, ok := lookup(rec.ID)
		switch {
		case !ok || rec.Sandbox != "" && rec.Sandbox != id:
			r.drop(rec)
		case rec.Sandbox == "":
			r.update(rec.ID, func(c *record) { c.Sandbox = id })
		}
	}
}

// A stored record is never changed in place: a change writes a copy
// (change), so what get and all hand out, its Procs and maps included,
// stays as it was; readers must not modify it.

// get is the record of id.
func (r *records) get(id string) (record, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	rec, ok := r.m[id]
	if !ok {
		return record{}, false
	}
	return *rec, true
}

// all are the records.
func (r *records) all() []record {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]record, 0, len(r.m))
	for _, rec := range r.m {
		out = append(out, *rec)
	}
	return out
}

// clone is a copy of rec to change: its own Procs.
func (rec *record) clone() record {
	c := *rec
	c.Procs = append([]proc(nil), rec.Procs...)
	return c
}

// put writes rec, new or whole.
func (r *records) put(rec record) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.write(&rec)
}

// putNew writes rec, a create's, unless its id has a record already.
func (r *records) putNew(rec record) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, ok := r.m[rec.ID]; ok {
		return fmt.Errorf("sandbox %s already has an E2B record: %w", rec.ID, errdefs.ErrAlreadyExists)
	}
	return r.write(&rec)
}

// update changes the record of id; errdefs.ErrNotFound if there is none.
func (r *records) update(id string, fn func(*record)) error { return r.change(id, fn, true) }

// created records the sandbox a create made, without a sync (the
// pending record stays behind it: see record).
func (r *records) created(id, sandbox string) error {
	return r.change(id, func(rec *record) { rec.Sandbox = sandbox }, false)
}

// addProc is update for a command started: atomic but not fsynced (a
// write per command; what a host crash may lose is a pid of a process
// the crash took too, and exec ids never repeat, so no pid the front
// hands out again names an old command).
func (r *records) addProc(id string, fn func(*record)) error { return r.change(id, fn, false) }

func (r *records) change(id string, fn func(*record), sync bool) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	rec, ok := r.m[id]
	if !ok {
		return fmt.Errorf("sandbox %s is not an E2B sandbox: %w", id, errdefs.ErrNotFound)
	}
	c := rec.clone()
	fn(&c)
	return r.writeSync(&c, sync)
}

func (r *records) write(rec *record) error { return r.writeSync(rec, true) }

func (r *records) writeSync(rec *record, sync bool) error {
	if len(rec.Procs) > maxProcs {
		rec.Procs = rec.Procs[len(rec.Procs)-maxProcs:]
	}
	b, _ := json.Marshal(rec)
	write := durable.WriteFile
	if !sync {
		write = durable.Replace
	}
	if err := write(r.file(rec), b, 0o600); err != nil {
		return fmt.Errorf("e2b record of %s: %w", rec.ID, err)
	}
	if old := r.m[rec.ID]; old != nil && r.file(old) != r.file(rec) {
		if old.Sandbox == "" && !sync {
			rec.pending = true // kept until this record is synced
		} else {
			os.Remove(r.file(old))
		}
	}
	if rec.pending && sync && rec.Sandbox != "" {
		os.Remove(r.pendingFile(rec.ID)) // pending no more
		rec.pending = false
	}
	r.m[rec.ID] = rec
	return nil
}

// remove forgets the record of id.
func (r *records) remove(id string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if rec := r.m[id]; rec != nil {
		delete(r.m, id)
		r.removeFiles(rec)
	}
}

// drop forgets rec if it is still the record of its id.
func (r *records) drop(rec record) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if cur := r.m[rec.ID]; cur != nil && cur.Sandbox == rec.Sandbox {
		delete(r.m, rec.ID)
		r.removeFiles(cur)
	}
}

// forget drops the record of the sandbox whose ID is sandbox, returning
// its E2B id ("": none).
func (r *records) forget(sandbox string) string {
	r.mu.Lock()
	defer r.mu.Unlock()
	for id, rec := range r.m {
		if rec.Sandbox == sandbox {
			delete(r.m, id)
			r.removeFiles(rec)
			return id
		}
	}
	return ""
}
