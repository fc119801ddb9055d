package main

import (
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"

	"github.com/spf13/cobra"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/durable"
)

func (a *app) screenCommand() *cobra.Command {
	var out string
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "screen NAME -o FILE",
		Short: "Save a full VM's screen as PNG",
		Long: `Screen saves the screen of a sandbox of the vm backend (a full VM) as a PNG file: what its
display shows now, the desktop or the console. It prints the screen's size and the sandbox's
count of screenshots, which grows by one with each. -o - writes the PNG to stdout. Other
backends have no screen (exit 8).

` + exitCodesHelp,
		Example: `  dsec screen vm1 -o shot.png
  dsec screen vm1 -o - | display`,
		Args:              exactArgs(1),
		ValidArgsFunction: a.completeSandboxes,
		RunE: func(cmd *cobra.Command, args []string) error {
			if out == "" {
				return usageError{errors.New("screen needs -o FILE (or -o - for stdout)")}
			}
			c, err := a.client()
			if err != nil {
				return err
			}
			png, info, err := c.Sandbox(args[0]).Screenshot(cmd.Context())
			if err != nil {
				return err
			}
			if out == "-" {
				_, err := a.stdout.Write(png)
				return err
			}
			if err := durable.Replace(out, png, 0o644); err != nil {
				return err
			}
			if asJSON {
				return a.printJSON(info)
			}
			_, err = fmt.Fprintf(a.stdout, "%s: %dx%d, screenshot %d\n", out, info.Width, info.Height, info.Seq)
			return err
		},
	}
	cmd.Flags().StringVarP(&out, "output", "o", "", "the PNG file to write (- for stdout)")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the screen's size and count as JSON")
	return cmd
}

func (a *app) inputCommand() *cobra.Command {
	var button string
	var double bool
	cmd := &cobra.Command{
		Use:   "input NAME ACTION ARGS...",
		Short: "Type, press keys, and move, click, drag or scroll the mouse of a full VM",
		Long: `Input acts on the keyboard or mouse of a sandbox of the vm backend (a full VM), as a person at
its screen would. ACTION is one of:

  type TEXT              type TEXT (ASCII, on a US keyboard)
  key KEY                press a key by name, with modifiers joined by + (Return, Tab, Escape,
                         BackSpace, Up, F5, a, ctrl+alt+t, shift+Tab, super)
  move X Y               move the pointer to the pixel (X, Y), (0, 0) the top left
  click X Y              move there and click (--button left, middle or right; --double)
  drag X1 Y1 X2 Y2       press the left button at (X1, Y1), move to (X2, Y2), release
  scroll N               turn the wheel N notches down (negative: up)

Points are pixels of the screen as dsec screen shows it. Other backends have no keyboard or
mouse (exit 8).

` + exitCodesHelp,
		Example: `  dsec input vm1 type 'echo hello'
  dsec input vm1 key Return
  dsec input vm1 click 100 200
  dsec input vm1 click 100 200 --button right
  dsec input vm1 drag 10 10 300 200
  dsec input vm1 scroll -3`,
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) < 2 {
				return usageError{fmt.Errorf("input needs a sandbox and an action: usage: %s (see --help)", cmd.UseLine())}
			}
			return nil
		},
		ValidArgsFunction: a.completeSandboxes,
		RunE: func(cmd *cobra.Command, args []string) error {
			in, err := inputOf(args[1], args[2:], button, double)
			if err != nil {
				return usageError{err}
			}
			c, err := a.client()
			if err != nil {
				return err
			}
			return c.Sandbox(args[0]).Input(cmd.Context(), in)
		},
	}
	cmd.Flags().StringVar(&button, "button", "left", "click's button: left, middle or right")
	cmd.Flags().BoolVar(&double, "double", false, "click twice")
	return cmd
}

// inputOf is the input an action with its arguments asks for.
func inputOf(action string, args []string, button string, double bool) (api.Input, error) {
	want := map[string]int{"type": 1, "key": 1, "move": 2, "click": 2, "drag": 4, "scroll": 1}
	n, ok := want[action]
	if !ok {
		return api.Input{}, fmt.Errorf("no input action %q: give type, key, move, click, drag or scroll", action)
	}
	if len(args) != n {
		return api.Input{}, fmt.Errorf("input %s takes %d argument(s), not %d (see --help)", action, n, len(args))
	}
	switch action {
	case "type":
		return api.Input{Text: args[0]}, nil
	case "key":
		return api.Input{Key: args[0]}, nil
	}
	nums := make([]int, len(args))
	for i, s := range args {
		v, err := strconv.Atoi(s)
		if err != nil {
			return api.Input{}, fmt.Errorf("input %s: %q is not a whole number", action, s)
		}
		nums[i] = v
	}
	switch action {
	case "move":
		return api.Input{Move: &api.Point{X: nums[0], Y: nums[1]}}, nil
	case "click":
		return api.Input{Click: &api.Click{Point: api.Point{X: nums[0], Y: nums[1]}, Button: button, Double: double}}, nil
	case "drag":
		return api.Input{Drag: &api.Drag{From: api.Point{X: nums[0], Y: nums[1]}, To: api.Point{X: nums[2], Y: nums[3]}}}, nil
	}
	if nums[0] == 0 {
		return api.Input{}, errors.New("input scroll 0 turns nothing: give a number of notches, negative for up")
	}
	return api.Input{Scroll: nums[0]}, nil
}

func (a *app) vncCommand() *cobra.Command {
	var listen string
	var revoke, asJSON bool
	cmd := &cobra.Command{
		Use:   "vnc NAME [--listen ADDR]",
		Short: "Watch and drive a full VM's screen with a VNC viewer",
		Long: `Vnc grants a token to the screen of a sandbox of the vm backend (a full VM) over VNC and prints
the WebSocket URL that opens with it (noVNC's url; the RFB protocol in binary messages). The
token opens that sandbox's screen alone, and nothing else of the worker; a new grant ends the
one before, and the sandbox's stop or removal, --revoke, or the worker's restart ends it and
its connections. VNC is off until a grant is asked for.

--listen ADDR serves the grant on a local TCP address for any VNC viewer (vncviewer,
remmina), until interrupted: each viewer's connection is carried over the WebSocket. Other
backends have no screen (exit 8).

` + exitCodesHelp,
		Example: `  dsec vnc vm1                              # wss://HOST:7443/v1/vnc/vm1?token=...
  dsec vnc vm1 --listen 127.0.0.1:5901      # then: vncviewer 127.0.0.1:5901
  dsec vnc vm1 --revoke`,
		Args:              exactArgs(1),
		ValidArgsFunction: a.completeSandboxes,
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.client()
			if err != nil {
				return err
			}
			sb := c.Sandbox(args[0])
			if revoke {
				return sb.RevokeVNC(cmd.Context())
			}
			g, err := sb.VNC(cmd.Context())
			if err != nil {
				return err
			}
			if listen == "" {
				if asJSON {
					return a.printJSON(struct {
						api.VNC
						URL string `json:"url"`
					}{g, c.VNCURL(g)})
				}
				if !c.Remote() { // the unix socket: no URL a browser reaches
					fmt.Fprintf(a.stderr, "dsec: the worker is on its unix socket: serve the grant with --listen ADDR, or reach it over TCP (dsec daemon --listen)\n")
					_, err := fmt.Fprintf(a.stdout, "%s?token=%s\n", g.Path, g.Token)
					return err
				}
				_, err := fmt.Fprintln(a.stdout, c.VNCURL(g))
				return err
			}
			l, err := net.Listen("tcp", listen)
			if err != nil {
				return usageError{fmt.Errorf("--listen %s: %w", listen, err)}
			}
			defer l.Close()
			fmt.Fprintf(a.stderr, "dsec: VNC of %s on %s (interrupt to end)\n", g.Sandbox, l.Addr())
			go func() { <-cmd.Context().Done(); l.Close() }()
			for {
				viewer, err := l.Accept()
				if err != nil {
					if cmd.Context().Err() != nil {
						return nil
					}
					return err
				}
				go func() {
					defer viewer.Close()
					vnc, err := c.DialVNC(cmd.Context(), g)
					if err != nil {
						fmt.Fprintf(a.stderr, "dsec: %v\n", err)
						return
					}
					defer vnc.Close()
					go func() { io.Copy(vnc, viewer); vnc.Close() }()
					io.Copy(viewer, vnc)
				}()
			}
		},
	}
	cmd.Flags().StringVar(&listen, "listen", "", "serve the grant on this local TCP address for a VNC viewer, e.g. 127.0.0.1:5901")
	cmd.Flags().BoolVar(&revoke, "revoke", false, "end the sandbox's grant and its connections")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the grant (its token and URL) as JSON")
	return cmd
}
