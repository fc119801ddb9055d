package journal

import (
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"time"

	"github.com/dsec-project/dsec/internal/durable"
)

// The journal's outputs stay within the sandbox's disk bound: before a
// step starts, what the journal holds (the outputs of ended steps and
// what running ones wrote so far) and the new step's cap must fit, or
// the outputs of the oldest ended steps are emptied until they do (and
// the cap is lowered to what is left when running steps' outputs alone
// leave less). Steps that run at once may together write past the bound
// by what their caps allowed them beyond what they had written when the
// next started; one step at a time never does. The journal on disk is
// counted once, on the first step with a bound, so that a worker that
// restarted counts what earlier ones left.

// reserve makes room for e's output, capped at limit, within bound (0:
// none) and returns e's cap. j.mu is held.
func (j *Journal) reserve(e *Exec, limit, bound int64) int64 {
	u := &j.usage
	u.Lock()
	defer u.Unlock()
	j.run(e)
	if bound <= 0 {
		return limit
	}
	limit = min(limit, bound)
	j.count()
	var running int64
	for r := range u.running {
		running += outputBytes(r.dir)
	}
	for len(u.outputs) > 0 && u.bytes+running+limit > bound {
		o := u.outputs[0]
		u.outputs = u.outputs[1:]
		u.bytes -= o.bytes
		j.drop(o.id)
	}
	return max(0, min(limit, bound-u.bytes-running))
}

// run counts e as running. u is locked.
func (j *Journal) run(e *Exec) {
	if j.usage.running == nil {
		j.usage.running = map[*Exec]bool{}
	}
	j.usage.running[e] = true
}

// release forgets e, which never started.
func (j *Journal) release(e *Exec) {
	j.usage.Lock()
	defer j.usage.Unlock()
	delete(j.usage.running, e)
}

// ended counts e's output, which its writer has closed.
func (j *Journal) ended(e *Exec) {
	u := &j.usage
	u.Lock()
	defer u.Unlock()
	delete(u.running, e)
	e.over = true
	if u.counted {
		j.account(e.ID, e.dir)
	}
}

// account adds what the output files under dir hold as the newest
// ended output. u is locked.
func (j *Journal) account(id, dir string) {
	n := outputBytes(dir)
	j.usage.bytes += n
	if n > 0 {
		j.usage.outputs = append(j.usage.outputs, output{id: id, bytes: n})
	}
}

func outputBytes(dir string) (n int64) {
	for _, name := range []string{"stdout", "stderr"} {
		if st, err := os.Stat(filepath.Join(dir, name)); err == nil {
			n += st.Size()
		}
	}
	return n
}

// count counts the outputs on disk, once: those of execs that ended,
// oldest first, and of any a worker left without a result (a call's);
// not those running in this journal, counted as they grow and when they
// end. j.mu and u are held.
func (j *Journal) count() {
	u := &j.usage
	if u.counted {
		return
	}
	u.counted = true
	type found struct {
		output
		finished time.Time
	}
	var ended []found
	for _, ent := range j.entries() {
		id, dir := ent.Name(), filepath.Join(j.dir, ent.Name())
		var res Result
		if e := j.execs[id]; e != nil {
			if !e.over {
				continue
			}
			res = e.res
		} else if r, err := j.result(id); err != nil {
			u.bytes += outputBytes(dir) // not ended, or not ours to drop
			continue
		} else {
			res = r
		}
		if n := outputBytes(dir); n > 0 {
			u.bytes += n
			ended = append(ended, found{output{id, n}, res.Finished})
		}
	}
	slices.SortStableFunc(ended, func(a, b found) int { return a.finished.Compare(b.finished) })
	for _, f := range ended {
		u.outputs = append(u.outputs, f.output)
	}
}

// drop empties the output of the ended exec id and marks its result.
func (j *Journal) drop(id string) {
	dir := filepath.Join(j.dir, id)
	for _, name := range []string{"stdout", "stderr"} {
		os.Truncate(filepath.Join(dir, name), 0)
	}
	if e := j.execs[id]; e != nil {
		e.dropped.Store(true)
		if !e.keep {
			return
		}
	}
	p := filepath.Join(dir, "result.json")
	b, err := os.ReadFile(p)
	if err != nil {
		return
	}
	var res Result
	if json.Unmarshal(b, &res) != nil {
		return
	}
	res.OutputDropped = true
	if b, err := json.Marshal(res); err == nil {
		// Not synced: a crash that loses the mark finds the output
		// short, as a crash may anyway (the output is not synced).
		j.logMark(res)
		durable.Replace(p, b, 0o600)
	}
}
