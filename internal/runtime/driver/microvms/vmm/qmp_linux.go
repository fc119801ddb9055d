package vmm

import (
	"bufio"
	"encoding/json"
	"fmt"
	"net"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// qmp is a client of QEMU's machine protocol on the shim's end of its
// socket: one command at a time, each answered by a return or an
// error; events are read and kept only by name, for waitEvent.
type qmp struct {
	c *net.UnixConn

	mu      sync.Mutex // one command at a time
	replies chan qmpReply

	evMu   sync.Mutex
	events map[string]int // how many of each event came
	evCh   chan struct{}  // closed and made anew on every event
}

type qmpReply struct {
	Return json.RawMessage `json:"return"`
	Error  *struct {
		Class string `json:"class"`
		Desc  string `json:"desc"`
	} `json:"error"`
	Event string `json:"event"`
}

// newQMP takes QMP's greeting on c and leaves command mode on.
func newQMP(c *net.UnixConn) (*qmp, error) {
	q := &qmp{c: c, replies: make(chan qmpReply, 1), events: map[string]int{}, evCh: make(chan struct{})}
	r := bufio.NewReaderSize(c, 64<<10)
	if _, err := r.ReadBytes('\n'); err != nil { // {"QMP": {...}}
		return nil, fmt.Errorf("QMP greeting: %w", err)
	}
	go q.read(r)
	if _, err := q.do("qmp_capabilities", nil); err != nil {
		return nil, err
	}
	return q, nil
}

func (q *qmp) read(r *bufio.Reader) {
	defer close(q.replies)
	for {
		line, err := r.ReadBytes('\n')
		if err != nil {
			return
		}
		var rep qmpReply
		if json.Unmarshal(line, &rep) != nil {
			continue
		}
		if rep.Event != "" {
			q.evMu.Lock()
			q.events[rep.Event]++
			close(q.evCh)
			q.evCh = make(chan struct{})
			q.evMu.Unlock()
			continue
		}
		q.replies <- rep
	}
}

// do runs a command (its arguments as JSON, fds passed along with it)
// and returns what it returned.
func (q *qmp) do(cmd string, args any, fds ...int) (json.RawMessage, error) {
	q.mu.Lock()
	defer q.mu.Unlock()
	msg := map[string]any{"execute": cmd}
	if args != nil {
		msg["arguments"] = args
	}
	b, _ := json.Marshal(msg)
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	if _, _, err := q.c.WriteMsgUnix(append(b, '\n'), oob, nil); err != nil {
		return nil, fmt.Errorf("QMP %s: %w", cmd, err)
	}
	rep, ok := <-q.replies
	if !ok {
		return nil, fmt.Errorf("QMP %s: QEMU went away", cmd)
	}
	if rep.Error != nil {
		return nil, fmt.Errorf("QMP %s: %s: %s", cmd, rep.Error.Class, rep.Error.Desc)
	}
	return rep.Return, nil
}

// seen is how many events of name came so far.
func (q *qmp) seen(name string) int {
	q.evMu.Lock()
	defer q.evMu.Unlock()
	return q.events[name]
}

// migrated waits for the migration under way to complete (query-migrate
// polled, and woken by every event), failing on its failure or after
// timeout.
func (q *qmp) migrated(timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		b, err := q.do("query-migrate", nil)
		if err != nil {
			return err
		}
		var st struct {
			Status    string `json:"status"`
			ErrorDesc string `json:"error-desc"`
		}
		json.Unmarshal(b, &st)
		switch st.Status {
		case "completed":
			return nil
		case "failed", "cancelled":
			return fmt.Errorf("the migration %s: %s", st.Status, st.ErrorDesc)
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the migration did not complete in %v (%s)", timeout, st.Status)
		}
		q.evMu.Lock()
		ch := q.evCh
		q.evMu.Unlock()
		select {
		case <-ch:
		case <-time.After(10 * time.Millisecond):
		}
	}
}
