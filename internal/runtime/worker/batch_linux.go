package worker

import (
	"encoding/json"
	"net/http"
	"sync"
	"time"

	"github.com/dsec-project/dsec/api"
)

// batch makes a batch's sandboxes at once (POST /v1/batches): each a
// create of its spec, through the same admission, answered as a JSON
// line as soon as it is made or fails. A client gone cancels the rest.
func (w *worker) batch(rw http.ResponseWriter, r *http.Request) {
	var req api.BatchRequest
	if err := decode(r, &req); err != nil {
		fail(rw, err)
		return
	}
	if err := req.Validate(); err != nil {
		fail(rw, err)
		return
	}
	defer time.AfterFunc(afterAnswer, w.host.Primed.Refill)
	rw.Header().Set("Content-Type", "application/x-ndjson")
	rw.WriteHeader(http.StatusOK)
	flush := http.NewResponseController(rw)
	flush.Flush()
	sc := w.scopeOf(r.Context())
	var mu sync.Mutex // the answer's lines, one at a time
	enc := json.NewEncoder(rw)
	var wg sync.WaitGroup
	for i := range req.Count {
		wg.Go(func() {
			spec := req.Spec
			if spec.Name != "" {
				spec.Name = api.BatchName(spec.Name, i)
			}
			item := api.BatchItem{Index: i}
			if sb, err := w.createSandbox(r.Context(), spec); err != nil {
				item.Error, _ = api.ErrorOf(err)
			} else {
				d := sc.showSandbox(w.describe(sb))
				item.Sandbox = &d
			}
			mu.Lock()
			defer mu.Unlock()
			enc.Encode(item)
			flush.Flush()
		})
	}
	wg.Wait()
}
