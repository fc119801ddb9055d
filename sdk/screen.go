package sdk

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"strconv"

	"github.com/dsec-project/dsec/api"
)

// maxScreenshot bounds a screenshot's PNG.
const maxScreenshot = 64 << 20

// Screenshot is the sandbox's screen now (a full VM's, backend vm), as
// PNG, with its size and the sandbox's count of screenshots.
func (s *Sandbox) Screenshot(ctx context.Context) ([]byte, api.Screenshot, error) {
	var info api.Screenshot
	resp, err := s.c.send(ctx, "GET", s.path("/screen"), nil)
	if err != nil {
		return nil, info, err
	}
	defer closeBody(resp.Body)
	b, err := io.ReadAll(io.LimitReader(resp.Body, maxScreenshot+1))
	if err != nil {
		return nil, info, err
	}
	if len(b) > maxScreenshot {
		return nil, info, fmt.Errorf("a screenshot of more than %d bytes", maxScreenshot)
	}
	info.Width, _ = strconv.Atoi(resp.Header.Get(api.HeaderScreenWidth))
	info.Height, _ = strconv.Atoi(resp.Header.Get(api.HeaderScreenHeight))
	info.Seq, _ = strconv.ParseInt(resp.Header.Get(api.HeaderScreenSeq), 10, 64)
	return b, info, nil
}

// Input acts on the sandbox's keyboard or mouse (a full VM's): one
// of in's fields.
func (s *Sandbox) Input(ctx context.Context, in api.Input) error {
	b, _ := json.Marshal(in)
	return s.c.do(ctx, "POST", s.path("/input"), bytes.NewReader(b), nil)
}

// Type types text on the sandbox's keyboard.
func (s *Sandbox) Type(ctx context.Context, text string) error {
	return s.Input(ctx, api.Input{Text: text})
}

// Press presses a key by name ("Return", "ctrl+alt+t").
func (s *Sandbox) Press(ctx context.Context, key string) error {
	return s.Input(ctx, api.Input{Key: key})
}

// Click clicks the left button at (x, y) of the screen.
func (s *Sandbox) Click(ctx context.Context, x, y int) error {
	return s.Input(ctx, api.Input{Click: &api.Click{Point: api.Point{X: x, Y: y}}})
}
